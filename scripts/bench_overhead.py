#!/usr/bin/env python3
"""Per-step engine overhead with the model's forward replaced by a no-op, in microseconds per step.

Decoding steady state at 64, 256 and 1024 running sequences: every request is prefilled first, then a few
untimed decode steps, then --steps timed steps. The model runner's `run` is patched to do only the input
preparation (`runner.prepare`: flattening, positions, slot mapping, block tables, device copies) and to
return precomputed logits of the right shape, so a step is:

    schedule (scheduler + block allocation) + prepare + sample (batched greedy sampler) + the rest
    (prefix-cache registration, stop checks, outputs)

A tiny random Llama (transformers LlamaConfig, saved to a temporary folder) stands in for the model:
nothing of the model runs, and the per-step work does not depend on its size, except the sampler's, which
scales with the vocabulary (--vocab, default SmolLM2's 49152).

    python scripts/bench_overhead.py
    python scripts/bench_overhead.py --seqs 64 256 1024 --steps 50 --prompt-len 128
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

import harness.bench as bc  # noqa: E402  (CPU tuning before torch)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024], help="running sequences")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per size")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence (sets block-table width)")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size of the stand-in model")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:N] (where prepare's tensors and the logits live)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def make_tiny_model(path: str, vocab: int, max_pos: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max_pos,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def max_new_tokens(num_seqs: int, args) -> int:
    """Enough that no sequence finishes before the timed steps end: sequences admitted first already
    decode while the later prompts are still being prefilled (one chunk of the token budget per step)."""
    prefill_steps = -(-num_seqs * args.prompt_len // max(num_seqs, 8192))
    return prefill_steps + args.warmup_steps + args.steps + 8


class Timer:
    def __init__(self):
        self.total = 0.0
        self.on = False

    def wrap(self, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
        return timed


def measure(model_dir: str, num_seqs: int, args) -> dict:
    from loom.engine.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.sampling_params import SamplingParams

    budget = max(num_seqs, 8192)
    max_tokens = max_new_tokens(num_seqs, args)
    per_seq_blocks = -(-(args.prompt_len + max_tokens + 1) // args.block_size) + 1
    # tiny model: 2 layers x 2 KV heads x head_dim 16 x float32 x (K, V) per token
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * args.block_size
    cfg = EngineConfig(model=model_dir, dtype="float32", device=args.device, block_size=args.block_size,
                       kv_cache_memory_bytes=bytes_per_block * (per_seq_blocks * num_seqs + 16),
                       max_num_seqs=num_seqs, max_num_batched_tokens=budget,
                       enable_prefix_caching=True)
    engine = LLMEngine(cfg, load_tokenizer=False)
    runner = engine.runner
    logits_pool = torch.randn(num_seqs, runner.vocab_size, device=runner.device)
    t_sched, t_prep, t_samp = Timer(), Timer(), Timer()
    prepare = t_prep.wrap(runner.prepare)

    def fake_run(batch, lora):
        ids, ctx, sampled = prepare(batch, lora)
        return logits_pool[:len(sampled)], sampled

    runner.run = fake_run
    engine.scheduler.schedule = t_sched.wrap(engine.scheduler.schedule)
    engine.sampler = t_samp.wrap(engine.sampler)

    g = torch.Generator().manual_seed(num_seqs)
    vocab = runner.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        ids = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()  # distinct: no prefix hits
        engine.add_request(f"s{i}", ids, params)
    # prefill (chunked by the token budget) until every sequence decodes
    steps = 0
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
        steps += 1
    for _ in range(args.warmup_steps):
        engine.step()
    assert len(engine.scheduler.running) == num_seqs, "not all sequences are running"
    for t in (t_sched, t_prep, t_samp):
        t.on = True
    step_times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - t)
        assert len(outs) == num_seqs
    n = args.steps
    s = bc.summarize(x * 1e6 for x in step_times)
    res = {
        "num_seqs": num_seqs, "steps": n, "prefill_steps": steps,
        "step_us": s["mean"], "step_us_p50": s["p50"], "step_us_p99": s["p99"],
        "schedule_us": t_sched.total / n * 1e6, "prepare_us": t_prep.total / n * 1e6,
        "sample_us": t_samp.total / n * 1e6,
        "block_table_width": max(len(q.block_table) for q in engine.scheduler.running),
    }
    res["rest_us"] = res["step_us"] - res["schedule_us"] - res["prepare_us"] - res["sample_us"]
    res["per_seq_us"] = res["step_us"] / num_seqs
    for i in range(num_seqs):
        engine.abort_request(f"s{i}")
    engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="loom-overhead-") as tmp:
        max_pos = args.prompt_len + max(max_new_tokens(n, args) for n in args.seqs) + 64
        model_dir = make_tiny_model(str(Path(tmp) / "tiny-llama"), args.vocab, max(256, max_pos))
        bc.progress(f"stand-in model: tiny random Llama, vocab {args.vocab}, at {model_dir}")
        for n in args.seqs:
            bc.progress(f"{n} running sequences: prefill, {args.warmup_steps} warm-up and {args.steps} timed decode steps")
            r = measure(model_dir, n, args)
            results.append(r)
            bc.progress(f"  {n}: {r['step_us']:.0f} us/step ({r['per_seq_us']:.2f} us per sequence)")
    rows = [[r["num_seqs"], r["step_us"], r["step_us_p99"], r["schedule_us"], r["prepare_us"], r["sample_us"], r["rest_us"],
             r["per_seq_us"]] for r in results]
    text = (f"engine step with a no-op forward, decoding steady state (prompt {args.prompt_len} tokens, vocab {args.vocab}, "
            f"block {args.block_size}, device {args.device}), microseconds per step (mean over {args.steps} steps)\n"
            + bc.table(["running seqs", "step us", "p99 us", "schedule", "prepare", "sample", "rest", "us/seq"], rows, 1))
    print(text, flush=True)
    data = {"config": vars(args), "machine": bc.machine_info(), "results": results, "report": text}
    out = bc.out_dir(args.out_dir)
    name = f"bench_overhead-{bc.stamp()}{'-' + args.tag if args.tag else ''}"
    bc.save_json(data, out / f"{name}.json")
    if not args.no_plot and bc.have_matplotlib():
        plt, fig, axes = bc.new_figure(1, 1, size=(7, 4.5))
        ax = axes[0][0]
        labels = [str(r["num_seqs"]) for r in results]
        bottom = [0.0] * len(results)
        for key in ("schedule_us", "prepare_us", "sample_us", "rest_us"):
            vals = [max(0.0, r[key]) for r in results]
            ax.bar(labels, vals, bottom=bottom, label=key.replace("_us", ""))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xlabel("running sequences")
        ax.set_ylabel("microseconds per step")
        ax.set_title("engine overhead per decode step (no-op forward)")
        ax.legend()
        bc.save_figure(plt, fig, out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
