"""Adapter churn on the real server: reload and unload while requests stream. Each request must see, whole,
the adapter version that was current when it was admitted (compared with an offline run of that version)."""
from __future__ import annotations

import threading

import pytest

from loom.engine.sampling_params import SamplingParams
from tests.reliability.conftest import MODEL, Stream, wait_for

PROMPTS = ["The capital of France is", "Once upon a time", "Write a haiku about the sea."]
MAX_TOKENS = 64
# Phase A streams this long: the reloads must be published while they run. A load while requests run takes ~30x its
# CPU time on the CPU (loads paced to lora_load_cpu_share of a core): about a second each for the demo adapters.
PHASE_A_TOKENS = 256


class Live:
    """One streamed greedy request on its own gRPC stream, collected in the background."""

    def __init__(self, server, prompt: str, lora: str | None, max_tokens: int = MAX_TOKENS):
        import tritonclient.grpc as grpcclient

        from harness.triton_client import make_inputs

        self.prompt, self.lora = prompt, lora
        self.text, self.tokens, self.error = "", 0, None
        self.done = threading.Event()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=self._cb)
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if lora:
            params["lora_name"] = lora
        self.client.async_stream_infer(MODEL, make_inputs(prompt, params, return_num_output_tokens=True),
                                       request_id="live", enable_empty_final_response=True)

    def _cb(self, result=None, error=None):
        if error is not None:
            self.error = str(error)
            self.done.set()
            return
        resp = result.get_response()
        if resp.outputs:
            self.text += result.as_numpy("text_output")[0].decode()
            self.tokens += int(result.as_numpy("num_output_tokens").sum())
        final = resp.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            self.done.set()

    def close(self):
        self.client.stop_stream(cancel_requests=False)
        self.client.close()


@pytest.fixture(scope="module")
def refs(offline):
    jobs = [(p, a) for a in (None, "pirate", "robot") for p in PROMPTS]
    outs = offline.generate([p for p, _ in jobs], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                            lora_names=[a for _, a in jobs])
    out = {job: o.text for job, o in zip(jobs, outs)}
    long = offline.generate(PROMPTS, SamplingParams(max_tokens=PHASE_A_TOKENS, temperature=0, ignore_eos=True),
                            lora_names=["pirate"] * len(PROMPTS))
    out.update({(p, "pirate", PHASE_A_TOKENS): o.text for p, o in zip(PROMPTS, long)})
    return out


def started(reqs, timeout=120.0) -> bool:
    return wait_for(lambda: all(r.tokens >= 1 or r.done.is_set() for r in reqs), timeout, 0.02)


def test_reload_and_unload_while_streaming_each_request_keeps_its_version(server, adapter_root, refs):
    ops = Stream(server)
    live: list[Live] = []
    try:
        res, err = ops.adapter_op("load", "swap", str(adapter_root / "pirate"))
        assert err is None, err
        v1 = res["result"]["version"]
        # Phase A: admitted while swap = pirate weights (and robot, no adapter alongside).
        phase_a = [Live(server, p, "swap", PHASE_A_TOKENS) for p in PROMPTS]
        others = [Live(server, PROMPTS[0], "robot"), Live(server, PROMPTS[1], None)]
        live += phase_a + others
        assert started(phase_a + others)
        # Swap in other weights under the same name, and reload robot in place, while they stream.
        res, err = ops.adapter_op("reload", "swap", str(adapter_root / "robot"))
        assert err is None, err
        assert res["result"]["version"] != v1
        res, err = ops.adapter_op("reload", "robot")
        assert err is None, err
        overlapped = sum(not r.done.is_set() for r in phase_a)
        # Phase B: admitted after the reload was published -> robot weights.
        phase_b = [Live(server, p, "swap") for p in PROMPTS]
        live += phase_b
        assert started(phase_b)
        listing, err = ops.adapter_op("list")
        assert err is None
        swap = next(d for d in listing["result"] if d["name"] == "swap")
        assert swap["refs"] >= sum(not r.done.is_set() for r in phase_b)
        # Unload while phase B streams: they finish with their version; new requests are refused.
        res, err = ops.adapter_op("unload", "swap")
        assert err is None, err
        late = Live(server, PROMPTS[0], "swap")
        live.append(late)
        for r in live:
            assert r.done.wait(300), "request did not finish"
        assert late.error is not None and late.error.startswith("lora_name: unknown adapter 'swap'")
        for r in phase_a:
            assert r.error is None, r.error
            assert r.text == refs[(r.prompt, "pirate", PHASE_A_TOKENS)], \
                "a request admitted before the reload saw other weights"
        for r in phase_b:
            assert r.error is None, r.error
            assert r.text == refs[(r.prompt, "robot")], "a request admitted after the reload saw other weights"
        assert others[0].text == refs[(PROMPTS[0], "robot")] and others[1].text == refs[(PROMPTS[1], None)]
        print(f"phase A requests still streaming when the reload was published: {overlapped}/{len(phase_a)}")
        assert overlapped >= 1, "the reload finished after every phase-A request: the test did not overlap them"

        # Every ref is released and every KV block free once they are done.
        def idle():
            info, err = ops.adapter_op("info")
            r = info["result"]
            return r if (r["adapters"]["refs"] == 0 and r["kv_blocks_used"] == 0 and r["num_active"] == 0) else None
        r = wait_for(idle, 20, 0.2)
        assert r, ops.adapter_op("info")
        assert "swap" not in [d["name"] for d in ops.adapter_op("list")[0]["result"]]
    finally:
        for r in live:
            r.close()
        ops.close()


def test_load_then_unload_while_requests_stream_repeatedly(server, adapter_root, refs):
    """Load, stream, unload under the streams, load again: the streams finish with the loaded weights."""
    ops = Stream(server)
    live = []
    try:
        for _ in range(2):
            res, err = ops.adapter_op("load", "swap2", str(adapter_root / "robot"))
            assert err is None, err
            batch = [Live(server, p, "swap2", max_tokens=16) for p in PROMPTS]
            live += batch
            assert started(batch)  # admitted (each holds its ref), so the unload cannot refuse them
            res, err = ops.adapter_op("unload", "swap2")  # while they stream
            assert err is None, err
            for r in batch:
                assert r.done.wait(300)
                assert r.error is None, r.error
                assert r.text == refs[(r.prompt, "robot")][:len(r.text)] and r.tokens == 16
        info = wait_for(lambda: (lambda i: i if i["adapters"]["refs"] == 0 else None)(
            ops.adapter_op("info")[0]["result"]), 20, 0.2)
        assert info, "adapter refs outstanding"
    finally:
        for r in live:
            r.close()
        ops.close()
