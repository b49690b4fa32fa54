"""Does the engine's start-up warm-up launch every Triton variant that serving then launches? Checked on CPU for
sm_90 (harness.triton_variants records each launch's specialisation; nothing is compiled or run).

For each scenario a tiny bf16 model is started (the warm-up's launches are recorded), then serves a randomized
workload - prompts of 1 to ~200 tokens arriving over time, chunked prefill, prefix hits, preemption, n = 2,
prompt logprobs, adapters of different ranks and module groups mixed with plain rows, decode batches of every
size through the graph path and past it - and every variant serving launched must have been launched by the
warm-up. Prints one JSON line per scenario; exits 1 if any variant was missed.

    python scripts/warmup_coverage.py [--scenarios llama_lora,mixtral,gemma2] [--steps 300]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: real @jit functions are recorded
os.environ["LOOM_FORCE_TRITON"] = "1"  # CPU tensors take the Triton launchers

import torch  # noqa: E402

from harness.triton_variants import VariantRecorder, describe  # noqa: E402

SCENARIOS = ("llama_lora", "mixtral", "gemma2")


def _model(name: str, work: str):
    """-> (model dir, adapter root or None, adapter names)."""
    if name == "llama_lora":
        from harness.lora import make_peft_adapter, make_tiny_llama

        base = make_tiny_llama(os.path.join(work, "base"), seed=0)
        root = os.path.join(work, "adapters")
        specs = [("r1q", 1, ["q_proj"]), ("r8all", 8, "all-linear"), ("r24attn", 24, ["q_proj", "k_proj", "v_proj",
                                                                                         "o_proj"]),
                 ("r40mlp", 40, ["gate_proj", "up_proj", "down_proj"])]
        for i, (n, r, tm) in enumerate(specs):
            make_peft_adapter(base, os.path.join(root, n), seed=10 + i, r=r, alpha=2 * r, target_modules=tm)
        return base, root, [s[0] for s in specs]
    from harness.hf_models import make_hf_model

    _, path = make_hf_model(name, work)
    return path, None, []


def scenario(name: str, steps: int, seed: int) -> dict:
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as work:
        path, root, names = _model(name, work)
        kw = dict(model=path, device="cpu", dtype="bfloat16", block_size=16, max_num_seqs=12,
                  max_num_batched_tokens=96, cuda_graph_max_batch=8, kv_cache_memory_bytes=0)
        if root:
            kw.update(adapter_roots=[root], max_lora_rank=64, lora_memory_bytes=8 << 20)
        with VariantRecorder() as rec:
            probe = LLMEngine(EngineConfig(**dict(kw, kv_cache_memory_bytes=1 << 20)), load_tokenizer=False)
            per_block = probe.runner.bytes_per_block
            rec.take()
            del probe
            eng = LLMEngine(EngineConfig(**dict(kw, kv_cache_memory_bytes=24 * per_block)), load_tokenizer=False)
            warm = rec.take()
            assert eng.runner.warmup is not None and eng.runner.warmup.steps > 0, "the warm-up did not run"
            for n in names:
                eng.adapters.load(n)
            vocab = eng.runner.vocab_size
            stems = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 17)]
            served = 0
            for step in range(steps):
                if rng.random() < 0.35 and len(eng.requests) < 14:
                    n = rng.choice([1, 2, 3, 9, 16, 31, 33, 60, 120, 200])
                    prompt = [rng.randrange(3, vocab) for _ in range(n)]
                    if rng.random() < 0.3:
                        prompt = rng.choice(stems) + prompt[:rng.randrange(0, 5)]
                    n = 2 if rng.random() < 0.1 else 1
                    p = SamplingParams(max_tokens=rng.randint(1, 24), temperature=1.0 if n > 1 else 0.0, n=n,
                                       ignore_eos=True, prompt_logprobs=1 if rng.random() < 0.05 else None)
                    lora = rng.choice(names + [None, None]) if names else None
                    eng.add_request(f"q{step}", prompt, p, lora)
                for o in eng.step():
                    served += len(o.new_token_ids)
                    assert o.error is None, o.error
            graph_steps = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
            serve = rec.take()
    missing = sorted(describe(k) for k in serve - warm)
    return {"scenario": name, "warmup_variants": len(warm), "serving_variants": len(serve), "tokens": served,
            "graph_steps": graph_steps, "preemptions": eng.scheduler.num_preemptions, "missing": missing}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    bad = 0
    for name in args.scenarios.split(","):
        res = scenario(name, args.steps, args.seed)
        print(json.dumps(res), flush=True)
        bad += bool(res["missing"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
