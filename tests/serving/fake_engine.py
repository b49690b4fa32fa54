"""A tiny engine implementing the LLMEngine contract (docs/CONTRACTS.md), for tests of the glue around it.

Token ids are letters: id i decodes to chr(ord('a') + i % 26). Each running request makes one token per
step: the next letter after the last prompt/output token. KV blocks: one per 4 tokens per request.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from loom.engine.outputs import EngineStats, StepOutput, TokenLogprob
from loom.errors import RequestError


def letter(i: int) -> str:
    return chr(ord("a") + i % 26)


class FakeTokenizer:
    """Enough of a transformers tokenizer for the real IncrementalDetokenizer."""
    eos_token_id = 25  # 'z'
    added_tokens_decoder: dict = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - ord("a")) % 26 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(letter(i) for i in ids)


class FakeAdapters:
    def __init__(self):
        self.loaded: dict[str, str] = {}

    def load(self, name, path=None, wait=True):
        self.loaded[name] = path or name
        info = {"name": name, "path": path}
        if wait:
            return info
        fut = Future()  # like the real registry: the weights load in the background
        threading.Timer(0.01, fut.set_result, (info,)).start()
        return fut

    def reload(self, name, path=None, wait=True):
        return self.load(name, path, wait)

    def unload(self, name):
        if name not in self.loaded:
            raise RequestError("lora_name", f"adapter {name!r} is not loaded")
        del self.loaded[name]
        return {"name": name}

    def list(self):
        return sorted(self.loaded)


@dataclass
class _R:
    rid: str
    last: int
    max_tokens: int
    want_logprobs: bool
    n_prompt: int
    out: int = 0
    cum: float = 0.0


class FakeEngine:
    def __init__(self, max_prompt: int = 64, gate: threading.Event | None = None):
        self.tokenizer = FakeTokenizer()
        self.adapters = FakeAdapters()
        self.max_prompt = max_prompt
        self.gate = gate  # when set, step() waits for it (to hold requests in the queue)
        self.running: dict[str, _R] = {}
        self.aborted: list[str] = []
        self._abort_echo: list[str] = []
        self.fail_next_step = False
        self.steps = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.last_step_request_ids: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params, lora_name=None):
        if not prompt_token_ids:
            raise RequestError("prompt", "is empty")
        if len(prompt_token_ids) > self.max_prompt:
            raise RequestError("prompt", f"the prompt has {len(prompt_token_ids)} tokens; at most {self.max_prompt}")
        if lora_name is not None and lora_name not in self.adapters.loaded:
            raise RequestError("lora_name", f"unknown adapter {lora_name!r}")
        self.running[request_id] = _R(request_id, prompt_token_ids[-1], params.max_tokens, params.logprobs is not None,
                                      len(prompt_token_ids))

    def abort_request(self, request_id, reason="abort", error=None, index=None):
        # one completion per request here: aborting index 0 aborts the request
        if index not in (None, 0):
            return
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)
            self._abort_echo.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.running or self._abort_echo)

    def step(self):
        if self.gate is not None:
            self.gate.wait()
        self.steps += 1
        self.last_step_request_ids = list(self.running)
        outs = [StepOutput(rid, [], None, True, "abort", 0, 0, 0.0) for rid in self._abort_echo]
        self._abort_echo.clear()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # transient, not sticky
        for r in list(self.running.values()):
            tok = (r.last + 1) % 26
            r.last, r.out = tok, r.out + 1
            r.cum += -0.5
            lp = [TokenLogprob(tok, -0.5, [(tok, -0.5), ((tok + 1) % 26, -1.0)])] if r.want_logprobs else None
            done = r.out >= r.max_tokens
            if done:
                del self.running[r.rid]
            timing = (time.monotonic(), time.monotonic()) if r.out == 1 else None  # as the engine: first token only
            outs.append(StepOutput(r.rid, [tok], lp, done, "length" if done else None, r.n_prompt, 0, r.cum,
                                   timing=timing))
        return outs

    def stats(self):
        used = sum((r.n_prompt + r.out + 3) // 4 for r in self.running.values())
        return EngineStats(num_running=len(self.running), num_waiting=0, kv_blocks_used=used, kv_blocks_total=100)
