"""gpu_check section `sampler`: the sampler on the device against the same sampler on the CPU.

Same logits, parameters, seeds and steps on both: the drawn tokens must be identical (the draw is a counter-based
hash of (seed, step) and an inverse CDF, so it does not depend on the device), the raw logprobs within 1e-4, the
top-k logprob ids identical (up to ties). Batches: every parameter mixed, all random rows, all greedy rows.
In --cpu-smoke both sides run on the CPU (the code path only).
"""
from __future__ import annotations

import random

import torch

from loom.engine.sample.sampler import Sampler, SamplingBatch
from loom.engine.sampling_params import SamplingParams as SP

PARAMS = [
    SP(temperature=0.0),
    SP(temperature=1.0),
    SP(temperature=0.7, top_p=0.9),
    SP(temperature=1.3, top_k=40),
    SP(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02, logprobs=5),
    SP(temperature=1.1, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3),
    SP(temperature=1.0, min_p=0.3, min_tokens=5, stop_token_ids=[1]),
    SP(temperature=0.0, presence_penalty=1.0, logprobs=2),
    SP(temperature=1.0, top_k=500, top_p=0.99),
    SP(temperature=0.5, top_p=0.5, repetition_penalty=0.8),
]


def check_batch(kind: str, rows: int, vocab: int, seed: int, dev: str) -> dict:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pool = {"mixed": PARAMS, "random": [p for p in PARAMS if p.temperature > 0],
            "greedy": [p for p in PARAMS if p.temperature == 0]}[kind]
    params = [pool[rng.randrange(len(pool))] for _ in range(rows)]
    seeds = [rng.getrandbits(63) for _ in range(rows)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(rows)]
    stops = [[1, 2]] * rows
    logits = torch.randn(rows, vocab, generator=g) * 3

    def sample(device):
        b = SamplingBatch.build(params, seeds, prompts, outputs, stops, vocab, device)
        out = Sampler()(logits.to(device), b)
        return out.token_ids.cpu(), out.logprobs.cpu(), out.topk_ids, out.topk_logprobs

    ref, got = sample("cpu"), sample(dev)
    diff = (ref[0] != got[0]).nonzero().flatten().tolist()
    assert not diff, f"rows {diff[:8]} drew different tokens (cpu {ref[0][diff[:8]].tolist()}, " \
        f"{dev} {got[0][diff[:8]].tolist()})"
    lp_err = float((ref[1] - got[1]).abs().max())
    assert lp_err <= 1e-4, f"logprobs differ by {lp_err:.2e}"
    if ref[2] is not None:
        same = ref[2] == got[2].cpu()
        tied = (ref[3][:, :-1] - ref[3][:, 1:]).abs() < 1e-5  # neighbours this close may swap places
        tied = torch.cat([tied, torch.zeros_like(tied[:, :1])], 1) | torch.cat([torch.zeros_like(tied[:, :1]), tied], 1)
        assert bool((same | tied).all()), "top-k logprob ids differ"
    return {"rows": rows, "vocab": vocab, "random_rows": sum(p.temperature > 0 for p in params), "lp_err": lp_err}


def run(rec, opts) -> None:
    rows, vocab = (16, 1000) if opts.smoke else (64, 32000)
    rounds = 1 if opts.smoke else 4
    for kind in ("mixed", "random", "greedy"):
        for r in range(rounds):
            rec.run(f"{kind} batch {r}: {opts.device} vs cpu", check_batch, kind, rows, vocab, 100 * r + len(kind),
                    opts.device)
    if opts.device == "cuda":  # a large vocabulary too (Llama 3's)
        rec.run("mixed batch, vocab 128256", check_batch, "mixed", 32, 128256, 7, opts.device)
