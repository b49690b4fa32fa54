#!/usr/bin/env python3
"""Speculative decoding (prompt lookup) against the same engine without it: tokens/s, mean latency, acceptance.

Two workloads on the default model, greedy (outputs are the same tokens with and without speculation):
* grounded: repeat / quote / extract prompts built from paragraphs of the repository's docs/*.md, whose answers
  copy their input (where prompt lookup finds its proposals);
* open-ended: questions whose answers are not in the prompt (speculation must cost next to nothing).
Each at batch 1 (requests one after another), 4 and 32 (all at once). Prints a table of ratios and the targets:
grounded batch 1 >= 1.8x tokens/s, open-ended batch 32 >= 0.97x (the measured back-off). With --vllm-python
(or LOOM_VLLM_PYTHON), vLLM's CPU build runs the same batches without and with its n-gram speculation (ignore_eos:
each of its requests makes exactly max_tokens), in the same run.

    python scripts/bench_spec.py                     # the table (a few minutes on 2 cores)
    python scripts/bench_spec.py --max-tokens 16 --batches 1 4   # smoke
    python scripts/bench_spec.py --method draft_model --draft-model DIR   # a draft model with the same tokenizer
    python scripts/bench_spec.py --vllm-python /work/vllm-venv/bin/python --vllm-threads auto   # with vLLM
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import harness.bench  # noqa: F401  (CPU tuning before torch)
from harness.default_model import ensure_default_model
from loom import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
ASKS = ("Repeat the following paragraph exactly, word for word.",
        "Quote the following text verbatim and add nothing.",
        "Copy the sentences of this paragraph that mention a configuration key, unchanged.",
        "Rewrite the following paragraph as a bulleted list, keeping its wording.")
OPEN = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a child why the sky is blue.", "What are the benefits of learning a second language?",
        "Describe a perfect autumn day in the mountains.", "Give advice to someone starting their first job.",
        "Why do cats purr? Explain the theories.", "Invent a recipe for a new kind of sandwich.",
        "Compare trains and airplanes for travel in Europe.")


def paragraphs(n: int) -> list[str]:
    """Prose paragraphs of docs/*.md (no tables or code), 200-700 characters, in a fixed order."""
    out = []
    for md in sorted((ROOT / "docs").glob("*.md")):
        for p in re.split(r"\n\s*\n", md.read_text()):
            p = " ".join(p.split())
            if 200 <= len(p) <= 700 and not p.startswith(("|", "#", "```", "-", "*")):
                out.append(p)
    return [out[i % len(out)] for i in range(n)]


def prompts(tok, kind: str, n: int) -> list[list[int]]:
    msgs = ([f"{ASKS[i % len(ASKS)]}\n\n{p}" for i, p in enumerate(paragraphs(n))] if kind == "grounded"
            else [OPEN[i % len(OPEN)] for i in range(n)])
    return [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for m in msgs]


def timed(llm: LLM, batch: list[list[int]], sp: SamplingParams, one_by_one: bool) -> tuple[float, list[float], int]:
    """(wall seconds, per-request latency, tokens) with the requests all at once, or one after another."""
    groups = [[p] for p in batch] if one_by_one else [batch]
    lat, tokens = [], 0
    t0 = time.perf_counter()
    for g in groups:
        start = time.perf_counter()
        for out in llm.stream(g, sp):
            if out.finished:
                lat.append(time.perf_counter() - start)
                tokens += len(out.token_ids)
    return time.perf_counter() - t0, lat, tokens


def vllm_rates(args, model: str, work: dict, k: int) -> dict:
    """vLLM's CPU build without and with its n-gram speculation over the same batches (one engine each, per
    --vllm-threads setting; the faster setting kept): {(kind, batch): {"plain": tok/s, "ngram": tok/s}} or an
    "error" entry. Its greedy decoding runs with ignore_eos, so each request makes exactly max_tokens."""
    from harness.vllm_peer import best, run_vllm_settings

    keys = {f"{kind}-{b}": (kind, b) for kind, b in work}
    runs = [{"name": name, "prompts": work[key], "sequential": key[1] == 1, "repeats": args.repeats}
            for name, key in keys.items()]
    job = {"model": model, "prompts": runs[0]["prompts"], "max_tokens": args.max_tokens, "runs": runs,
           "dtype": "float32", "max_model_len": 2048, "warmup": "all"}
    out: dict = {}
    for label, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2})):
        res = run_vllm_settings(args, {**job, "speculative_config": spec}, lambda m: print(f"  {m}", flush=True),
                                label=f"vllm {label}")
        name = best(res)
        if name is None:
            out.setdefault("error", {})[label] = next(iter(res.values()))["error"].splitlines()[0]
            continue
        for run_name, key in keys.items():
            out.setdefault(key, {})[label] = res[name]["runs"][run_name]["tokens_per_s"]
    return out


def main(argv=None) -> int:
    from harness.vllm_peer import add_vllm_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--workloads", nargs="+", default=["grounded", "open-ended"], choices=["grounded", "open-ended"])
    ap.add_argument("--batch1-requests", type=int, default=4, help="requests run one by one at batch 1")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs of each")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the config's)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    ap.add_argument("--draft-model", default="", help="the draft model's directory (method draft_model)")
    ap.add_argument("--backoff", default=None, choices=["measured", "off"], help="default: the config's")
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    add_vllm_arguments(ap)
    args = ap.parse_args(argv)
    spec_cfg = {"method": args.method}
    if args.method == "draft_model":
        spec_cfg["model"] = args.draft_model
    for key, val in (("num_speculative_tokens", args.k), ("disable_by_batch_size", args.disable_by_batch_size),
                     ("backoff", args.backoff)):
        if val is not None:
            spec_cfg[key] = val
    model = str(ensure_default_model())
    kw = dict(kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    base, spec = LLM(model, **kw), LLM(model, speculative_config=spec_cfg, **kw)
    print(f"speculative_config: {spec.engine.config.speculative_config}")
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tok = base.engine.tokenizer
    for llm in (base, spec):  # warm-up: first-use costs out of the timings
        llm.generate(prompts(tok, "grounded", 2), SamplingParams(temperature=0.0, max_tokens=8))
    work = {(kind, b): prompts(tok, kind, args.batch1_requests if b == 1 else b)
            for kind in args.workloads for b in args.batches}
    rows, ok = [], True
    for (kind, b), batch in work.items():
        # best of --repeats runs each: other processes' load makes single runs noisy
        tb, lb, nb = min(timed(base, batch, sp, b == 1) for _ in range(args.repeats))
        s0 = spec.engine.stats().spec_decoding
        ts, ls, ns = timed(spec, batch, sp, b == 1)
        s1 = spec.engine.stats().spec_decoding
        for _ in range(args.repeats - 1):
            ts, ls, ns = min((ts, ls, ns), timed(spec, batch, sp, b == 1))
        drafted = s1.num_draft_tokens - s0.num_draft_tokens
        acc = (s1.num_accepted_tokens - s0.num_accepted_tokens) / drafted if drafted else 0.0
        tps_b, tps_s = nb / tb, ns / ts
        r_tps, r_lat = tps_s / tps_b, (sum(ls) / len(ls)) / (sum(lb) / len(lb))
        target = {("grounded", 1): 1.8, ("open-ended", 32): 0.97}.get((kind, b))
        verdict = "" if target is None else ("PASS" if r_tps >= target else "FAIL") + f" (>= {target}x)"
        ok = ok and (target is None or r_tps >= target)
        rows.append((kind, b, tps_b, tps_s, r_tps, sum(lb) / len(lb), sum(ls) / len(ls), r_lat, acc,
                     s1.num_drafts - s0.num_drafts, nb == ns, verdict))
        print(f"  done {kind} batch {b}: {tps_b:.1f} -> {tps_s:.1f} tok/s ({r_tps:.2f}x), acceptance {acc:.2f}",
              flush=True)
    peer = {}
    if args.vllm_python:
        k = spec.engine.config.speculative_config.num_speculative_tokens
        peer = vllm_rates(args, model, work, k)
        if "error" in peer:
            print(f"vLLM failed: {peer['error']}")
    print("\n| workload | batch | tok/s base | tok/s spec | ratio | mean lat base s | mean lat spec s | lat ratio "
          "| acceptance | drafts | same token count | target |" + (" vLLM tok/s | vLLM ngram tok/s | vLLM ratio | "
                                                                  "loom spec / vLLM ngram |" if peer else ""))
    print("| --- " * (12 + (4 if peer else 0)) + "|")
    for kind, b, tb, ts, r, lb, ls, rl, acc, nd, same, v in rows:
        line = (f"| {kind} | {b} | {tb:.1f} | {ts:.1f} | {r:.2f}x | {lb:.2f} | {ls:.2f} | {rl:.2f}x | {acc:.2f} | "
                f"{nd} | {same} | {v} |")
        if peer:
            vp = peer.get((kind, b), {})
            vb, vs = vp.get("plain"), vp.get("ngram")

            def f(x, fmt):
                return format(x, fmt) if x is not None else "-"
            line += (f" {f(vb, '.1f')} | {f(vs, '.1f')} | {f(vs / vb if vb and vs else None, '.2f')}x | "
                     f"{f(ts / vs if vs else None, '.2f')}x |")
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
