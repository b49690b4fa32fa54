"""Tests of backend/sampler.py: each sampling parameter against a direct computation on known logits."""
from __future__ import annotations

import math
import random

import pytest
import torch

from loom.engine.sample.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    counter_uniform,
    mix64,
    row_keys,
    sample_from_logits,
)
from loom.engine.sampling_params import SamplingParams as SP

M64 = (1 << 64) - 1


def build(params, seeds=None, prompts=None, outputs=None, stops=None, vocab=None, device="cpu"):
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(n)),
        prompts if prompts is not None else [[1, 2, 3]] * n,
        outputs if outputs is not None else [[]] * n,
        stops if stops is not None else [[]] * n,
        vocab,
        device,
    )


def sample_many(logits_row: torch.Tensor, params: SP, n: int, seed0: int = 0) -> torch.Tensor:
    """n draws of the same row with seeds seed0..seed0+n-1 (one batch of n rows)."""
    V = logits_row.numel()
    b = build([params] * n, seeds=list(range(seed0, seed0 + n)), vocab=V)
    return Sampler()(logits_row[None, :].expand(n, V).contiguous(), b).token_ids


def freqs(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def check_distribution(tokens: torch.Tensor, expected: torch.Tensor, tol: float = 0.015) -> None:
    """Empirical frequencies vs expected probs: max abs diff <= tol and chi-square below the 0.1% critical value."""
    V = expected.numel()
    f = freqs(tokens, V)
    assert (f - expected).abs().max().item() <= tol, (f, expected)
    n = tokens.numel()
    support = expected > 0
    assert (f[~support] == 0).all(), "sampled a token of zero probability"
    chi2 = ((f[support] - expected[support]) ** 2 / expected[support]).sum().item() * n
    df = int(support.sum()) - 1
    if df == 0:
        return
    # chi-square 0.999 quantile (Wilson-Hilferty approximation)
    z = 3.0902
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit, f, expected)


# ------------------------------------------------------------------------------------------------
# Counter-based random numbers
# ------------------------------------------------------------------------------------------------
def _mix64_ref(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _to_i64(z: int) -> int:
    return z - (1 << 64) if z >= (1 << 63) else z


def test_mix64_matches_uint64_reference():
    rng = random.Random(1)
    vals = ([0, 1, 2**63 - 1, 12345] + [rng.randrange(2**63) for _ in range(200)]
            + [-rng.randrange(2**63) for _ in range(50)])
    got = mix64(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [_to_i64(_mix64_ref(v)) for v in vals]


def test_row_keys_and_uniform_match_reference():
    seeds = [0, 1, 7, 2**63 - 1, 424242]
    steps = [0, 5, 1000, 3, 0]
    G = 0x9E3779B97F4A7C15
    keys = row_keys(torch.tensor(seeds), torch.tensor(steps)).tolist()
    ref = [_to_i64(_mix64_ref(_mix64_ref(s) + (t + 1) * G)) for s, t in zip(seeds, steps)]
    assert keys == ref
    u = counter_uniform(torch.tensor(seeds), torch.tensor(steps))
    ref_u = [(((k & M64) >> 12) + 0.5) / 2**52 for k in ref]
    assert u.tolist() == ref_u
    assert ((u > 0) & (u < 1)).all()


def test_counter_uniform_is_uniform():
    n = 20000
    u = counter_uniform(torch.arange(n), torch.zeros(n, dtype=torch.int64))
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / n
    assert (hist - 0.1).abs().max() < 0.01
    # also across steps for one seed
    u2 = counter_uniform(torch.full((n,), 99), torch.arange(n))
    assert abs(u2.mean().item() - 0.5) < 0.01


# ------------------------------------------------------------------------------------------------
# Greedy
# ------------------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    torch.manual_seed(0)
    S, V = 16, 1000
    logits = torch.randn(S, V) * 4
    out = Sampler()(logits, build([SP(temperature=0)] * S, vocab=V))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch_are_argmax():
    torch.manual_seed(1)
    S, V = 12, 500
    logits = torch.randn(S, V)  # flat: random rows rarely hit the argmax
    params = [SP(temperature=0) if i % 3 == 0 else SP(temperature=1.5, top_p=0.9, top_k=(i % 4) * 50) for i in range(S)]
    outs = [[random.Random(i).randrange(V) for _ in range(5)] for i in range(S)]
    params[3] = SP(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5)  # greedy row with penalties
    b = build(params, outputs=outs, vocab=V)
    out = Sampler()(logits, b)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    pen3 = apply_penalties(logits[3:4], torch.tensor([[1, 2, 3]]), torch.tensor([outs[3]]), torch.tensor([1.5]),
                           torch.tensor([0.0]), torch.tensor([0.5]))
    expected = logits.argmax(-1)
    expected[3] = pen3.argmax(-1)[0]
    assert torch.equal(out.token_ids[greedy], expected[greedy])
    random_rows = [i for i in range(S) if i not in greedy]
    assert (out.token_ids[random_rows] != logits.argmax(-1)[random_rows]).any()


# ------------------------------------------------------------------------------------------------
# Temperature / plain sampling distribution
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])
    n = 20000
    tokens = sample_many(logits, SP(temperature=temperature), n)
    expected = torch.softmax(logits.double() / temperature, -1)
    check_distribution(tokens, expected)
    if temperature != 1.0:  # and it is not the T=1 distribution
        assert (freqs(tokens, 8) - torch.softmax(logits.double(), -1)).abs().max() > 0.05


def test_tiny_probabilities_are_not_lost():
    # one token with ~1e-4 probability among 5000 near-zero ones must still be drawn at its rate
    V = 5000
    logits = torch.full((V,), -30.0)
    logits[10] = 0.0
    logits[4000] = math.log(0.02)
    n = 20000
    tokens = sample_many(logits, SP(), n)
    p = torch.softmax(logits.double(), -1)
    f = freqs(tokens, V)
    assert abs(f[4000].item() - p[4000].item()) < 0.005
    assert f[10] > 0.97


def test_inverse_cdf_against_float64_reference():
    # 200k tail tokens of relative prob 5e-8 each (below float32 resolution next to 1.0) hold 1% of the mass
    V = 200_001
    row = torch.full((V,), math.log(5e-8))
    row[0] = 0.0
    logits = torch.cat([row[None], torch.randn(1, V)], 0)
    masked = logits.clone()
    masked[1, ::3] = float("-inf")
    for x in (logits, masked):
        for u in (0.2, 0.989, 0.995, 0.9999):
            uu = torch.tensor([u, u], dtype=torch.float64)
            got = sample_from_logits(x, uu)
            p = torch.exp(x.double() - x.double().amax(-1, keepdim=True))
            cdf = p.cumsum(-1)
            ref = [int(torch.nonzero(cdf[r] > u * cdf[r, -1])[0]) for r in range(2)]
            for r in range(2):  # equal up to float64 rounding of the cumulative sum
                assert abs(got[r].item() - ref[r]) <= 1 and torch.isfinite(x[r, got[r]]), (u, r, got, ref)
    assert sample_from_logits(row[None], torch.tensor([0.995], dtype=torch.float64)).item() > 90000


# ------------------------------------------------------------------------------------------------
# Top-k / top-p / min-p
# ------------------------------------------------------------------------------------------------
def test_top_k_only_samples_top_k_and_covers_them():
    torch.manual_seed(2)
    V = 64
    logits = torch.randn(V)
    k = 5
    tokens = sample_many(logits, SP(temperature=1.0, top_k=k), 10000)
    top = set(logits.topk(k).indices.tolist())
    assert set(tokens.tolist()) == top
    expected = torch.zeros(V, dtype=torch.float64)
    idx = torch.tensor(sorted(top))
    expected[idx] = torch.softmax(logits[idx].double(), -1)
    check_distribution(tokens, expected)


def _top_p_ref(probs: list[float], p: float) -> set[int]:
    """Smallest prefix (by decreasing prob) whose mass >= p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("top_p,expected", [(0.3, {2}), (0.5, {2, 4}), (0.7, {2, 4, 0}), (0.9, {2, 4, 0, 5}),
                                            (0.99, {0, 1, 2, 3, 4, 5})])
def test_top_p_hand_made(top_p, expected):
    probs = [0.15, 0.04, 0.4, 0.06, 0.25, 0.1]
    logits = torch.tensor(probs).log()[None]
    for cand in (2, 1024):  # candidate path (with fallback) and full-sort path
        out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([top_p]), max_candidates=cand)
        assert set(torch.nonzero(out[0] > float("-inf")).flatten().tolist()) == expected
        assert torch.equal(out[0][list(expected)], logits[0][list(expected)])
    assert _top_p_ref(probs, top_p) == expected
    tokens = sample_many(logits[0], SP(top_p=top_p), 4000)
    assert set(tokens.tolist()) == expected


def _top_k_top_p_ref(row: torch.Tensor, k: int, p: float) -> set[int]:
    V = row.numel()
    vals = row.tolist()
    order = sorted(range(V), key=lambda i: -vals[i])
    if 0 < k < V:
        order = order[:k]
    m = max(vals[i] for i in order)
    w = [math.exp(vals[i] - m) for i in order]
    tot = sum(w)
    probs = [x / tot for x in w]
    kept, mass = set(), 0.0
    for i, q in zip(order, probs):
        kept.add(i)
        mass += q
        if mass >= p:
            break
    return kept


def test_top_k_top_p_against_reference_random():
    torch.manual_seed(3)
    rng = random.Random(3)
    R, V = 40, 300
    logits = torch.randn(R, V) * torch.tensor([rng.choice([0.5, 2.0, 6.0]) for _ in range(R)])[:, None]
    ks = torch.tensor([rng.choice([0, 0, 1, 3, 20, 100, 299]) for _ in range(R)])
    ps = torch.tensor([rng.choice([1.0, 0.95, 0.8, 0.5, 0.1]) for _ in range(R)])
    ref = [_top_k_top_p_ref(logits[r], int(ks[r]), float(ps[r])) for r in range(R)]
    for cand in (8, 64, V):  # many rows need the sort fallback with 8 candidates, none with V
        out = apply_top_k_top_p(logits, ks, ps, max_candidates=cand)
        for r in range(R):
            assert set(torch.nonzero(out[r] > float("-inf")).flatten().tolist()) == ref[r], (cand, r)
    # top-k only path (top_p None)
    out = apply_top_k_top_p(logits, ks, None, top_k_max=int(ks.max()))
    for r in range(R):
        kept = set(torch.nonzero(out[r] > float("-inf")).flatten().tolist())
        assert kept == _top_k_top_p_ref(logits[r], int(ks[r]), 1.0)


def test_top_p_sampling_distribution_is_renormalised():
    logits = torch.tensor([0.15, 0.04, 0.4, 0.06, 0.25, 0.1]).log()
    tokens = sample_many(logits, SP(top_p=0.7), 20000)
    expected = torch.tensor([0.15, 0, 0.4, 0, 0.25, 0], dtype=torch.float64)
    check_distribution(tokens, expected / expected.sum())


def test_min_p_hand_made():
    probs = torch.tensor([0.5, 0.2, 0.05, 0.15, 0.09, 0.01])
    logits = probs.log()[None].repeat(3, 1)
    min_p = torch.tensor([0.0, 0.25, 0.35])  # thresholds 0, 0.125, 0.175 of prob
    out = apply_min_p(logits, min_p)
    kept = [set(torch.nonzero(out[r] > float("-inf")).flatten().tolist()) for r in range(3)]
    expected = [{i for i in range(6) if probs[i] >= m * probs.max()} for m in min_p.tolist()]
    assert kept == expected == [{0, 1, 2, 3, 4, 5}, {0, 1, 3}, {0, 1}]
    # through the sampler, with temperature: min-p applies to the tempered distribution
    T = 0.5
    tokens = sample_many(probs.log(), SP(temperature=T, min_p=0.05), 20000)
    tp = torch.softmax(probs.log().double() / T, -1)
    exp = torch.where(tp >= 0.05 * tp.max(), tp, torch.zeros_like(tp))
    # tempered ratios 1, .16, .09 kept; .032, .01, .0004 not
    assert set(torch.nonzero(exp).flatten().tolist()) == {0, 1, 3}
    check_distribution(tokens, exp / exp.sum())


def test_top_k_top_p_min_p_combined_in_sampler():
    torch.manual_seed(4)
    V = 50
    logits = torch.randn(V) * 2
    T, k, p, mp = 0.8, 10, 0.8, 0.1
    tokens = sample_many(logits, SP(temperature=T, top_k=k, top_p=p, min_p=mp), 20000)
    x = logits.double() / T
    kept = _top_k_top_p_ref(x.float(), k, p)
    probs = torch.softmax(x, -1)
    kept = {i for i in kept if probs[i] >= mp * probs.max()}
    expected = torch.zeros(V, dtype=torch.float64)
    idx = torch.tensor(sorted(kept))
    expected[idx] = torch.softmax(x[idx], -1)
    check_distribution(tokens, expected)


# ------------------------------------------------------------------------------------------------
# Penalties
# ------------------------------------------------------------------------------------------------
def _penalties_loop(logits, prompts, outputs, rep, pres, freq):
    out = logits.clone()
    for s in range(out.shape[0]):
        seen = set(prompts[s]) | set(outputs[s])
        for t in seen:
            v = out[s, t].item()
            out[s, t] = v / rep[s] if v > 0 else v * rep[s]
        for t in set(outputs[s]):
            c = outputs[s].count(t)
            out[s, t] -= pres[s] * 1.0 + freq[s] * c
    return out


def _pad(lists, pad):
    L = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (L - len(x)) for x in lists], dtype=torch.int64)


def test_apply_penalties_matches_loop():
    torch.manual_seed(5)
    rng = random.Random(5)
    S, V = 6, 40
    logits = torch.randn(S, V) * 3
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(0, 12))] for _ in range(S)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 15))] for _ in range(S)]
    prompts[0], outputs[1] = [], []  # empty prompt row, empty output row
    prompts[2], outputs[2] = [], []
    rep = [1.3, 0.8, 2.0, 1.0, 1.7, 1.1]
    pres = [0.5, -0.3, 0.0, 1.2, 0.0, -2.0]
    freq = [0.2, 0.7, 1.0, 0.0, -0.4, 0.3]
    got = apply_penalties(logits, _pad(prompts, V), _pad(outputs, V),
                          torch.tensor(rep), torch.tensor(pres), torch.tensor(freq))
    ref = _penalties_loop(logits, prompts, outputs, rep, pres, freq)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)
    # without repetition penalty (prompt_ids None): only presence / frequency
    got2 = apply_penalties(logits, None, _pad(outputs, V), torch.ones(S), torch.tensor(pres), torch.tensor(freq))
    torch.testing.assert_close(got2, _penalties_loop(logits, prompts, outputs, [1.0] * S, pres, freq),
                               rtol=0, atol=1e-6)


def test_penalties_through_sampler_greedy():
    # token 5 dominates; a repetition penalty (prompt) or frequency penalty (output) must flip the argmax
    V = 10
    base = torch.zeros(V)
    base[5], base[7] = 2.0, 1.5
    logits = base[None].repeat(4, 1)
    params = [SP(temperature=0), SP(temperature=0, repetition_penalty=1.5),
              SP(temperature=0, frequency_penalty=0.3), SP(temperature=0, presence_penalty=0.6)]
    prompts = [[5], [5], [1], [1]]
    outputs = [[], [], [5, 5], [5]]
    out = Sampler()(logits, build(params, prompts=prompts, outputs=outputs, vocab=V))
    # 2/1.5=1.33 < 1.5 ; 2-0.6=1.4 < 1.5 ; 2-0.6=1.4 < 1.5
    assert out.token_ids.tolist() == [5, 7, 7, 7]
    # and the batch's row for presence 0.6 with output [5] equals the formula
    b = build(params, prompts=prompts, outputs=outputs, vocab=V)
    pl = Sampler().process_logits(logits, b)
    torch.testing.assert_close(pl[3], base - 0.6 * (torch.arange(V) == 5))
    torch.testing.assert_close(pl[2], base - 0.3 * 2 * (torch.arange(V) == 5))
    torch.testing.assert_close(pl[1], torch.where(torch.arange(V) == 5, base / 1.5, base))
    torch.testing.assert_close(pl[0], base)


def test_sampler_penalised_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    prm = SP(temperature=0.7, repetition_penalty=1.4, presence_penalty=0.2, frequency_penalty=0.1)
    n = 20000
    prompts, outputs = [[4, 3]] * n, [[0, 0, 4]] * n
    b = build([prm] * n, seeds=list(range(n)), prompts=prompts, outputs=outputs, vocab=5)
    tokens = Sampler()(logits[None].repeat(n, 1), b).token_ids
    ref = _penalties_loop(logits[None], [[4, 3]], [[0, 0, 4]], [1.4], [0.2], [0.1])[0]
    check_distribution(tokens, torch.softmax(ref.double() / 0.7, -1))


# ------------------------------------------------------------------------------------------------
# min_tokens
# ------------------------------------------------------------------------------------------------
def test_min_tokens_masks_stop_ids_until_reached():
    V = 20
    logits = torch.zeros(6, V)
    logits[:, 3] = 10.0  # eos
    logits[:, 4] = 9.0  # a stop token id
    logits[:, 8] = 8.0
    params = ([SP(temperature=0, min_tokens=3, stop_token_ids=[4])] * 3
              + [SP(temperature=1.0, min_tokens=2, stop_token_ids=[4])] * 3)
    outputs = [[], [1, 1], [1, 1, 1], [], [1], [1, 1]]
    stops = [[3, 4]] * 6
    b = build(params, outputs=outputs, stops=stops, vocab=V)
    out = Sampler()(logits, b)
    assert out.token_ids[:3].tolist() == [8, 8, 3]
    pl = Sampler().process_logits(logits, b)
    for r, active in enumerate([True, True, False, True, True, False]):
        assert (pl[r, [3, 4]] == float("-inf")).all() == active
        assert torch.isfinite(pl[r, [0, 8]]).all()
    assert out.token_ids[3] not in (3, 4) and out.token_ids[4] not in (3, 4)
    # stop ids outside the vocabulary are ignored, not an error
    b = build([SP(temperature=0, min_tokens=1)], stops=[[3, 10**6]], vocab=V)
    assert Sampler()(logits[:1], b).token_ids.item() == 4
    # raw logprobs are unaffected by the mask
    assert out.logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[8].item(), abs=1e-6)


# ------------------------------------------------------------------------------------------------
# Seeds: reproducibility independent of batch composition
# ------------------------------------------------------------------------------------------------
TARGETS = [
    SP(temperature=1.0),
    SP(temperature=0.7, top_p=0.9),
    SP(temperature=1.3, top_k=40),
    SP(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02),
    SP(temperature=1.1, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3),
]
OTHERS = [
    SP(temperature=0),
    SP(temperature=0.5, top_p=0.5),
    SP(temperature=2.0, top_k=3, repetition_penalty=1.5),
    SP(temperature=1.0, min_p=0.3, min_tokens=5, stop_token_ids=[1]),
    SP(temperature=0, presence_penalty=1.0),
    SP(temperature=1.0, top_k=500, top_p=0.99),
]


@pytest.mark.parametrize("ti", range(len(TARGETS)))
def test_seeded_sampling_independent_of_batch(ti):
    torch.manual_seed(6)
    rng = random.Random(ti)
    V = 3000
    target = TARGETS[ti]
    target_logits = torch.randn(V) * 1.5
    prompt = [rng.randrange(V) for _ in range(30)]
    for seed, step in [(0, 0), (12345, 7), (2**62 + 3, 100)]:
        output = [rng.randrange(V) for _ in range(step)]
        alone = Sampler()(target_logits[None].clone(),
                          build([target], seeds=[seed], prompts=[prompt], outputs=[output], vocab=V))
        # batch of 7: target at position ti+1, six other rows with other params, seeds and positions
        pos = (ti + 1) % 7
        params, seeds, prompts, outputs, stops = [], [], [], [], []
        others = iter(OTHERS)
        for i in range(7):
            if i == pos:
                row = (target, seed, prompt, output, [])
            else:
                row = (next(others), rng.randrange(2**63), [rng.randrange(V) for _ in range(rng.randrange(1, 50))],
                       [rng.randrange(V) for _ in range(rng.randrange(0, 20))], [1, 2])
            for lst, v in zip((params, seeds, prompts, outputs, stops), row):
                lst.append(v)
        logits = torch.randn(7, V) * 2
        logits[pos] = target_logits
        batch = Sampler()(logits, build(params, seeds=seeds, prompts=prompts, outputs=outputs, stops=stops, vocab=V))
        assert batch.token_ids[pos] == alone.token_ids[0], (seed, step)
        assert batch.logprobs[pos] == alone.logprobs[0]


def test_seeds_and_steps_change_the_draw():
    V = 1000
    logits = torch.zeros(V)  # uniform
    a = sample_many(logits, SP(), 200, seed0=0)
    assert len(set(a.tolist())) > 150  # different seeds -> (mostly) different tokens
    b = sample_many(logits, SP(), 200, seed0=0)
    assert torch.equal(a, b)  # same seeds -> same tokens
    # same seed, successive steps differ
    n = 200
    bt = SamplingBatch.build([SP()] * n, [42] * n, [[1]] * n, [[0] * i for i in range(n)], [[]] * n, V, "cpu")
    toks = Sampler()(logits[None].repeat(n, 1), bt).token_ids
    assert len(set(toks.tolist())) > 150
    assert bt.steps.tolist() == list(range(n))


# ------------------------------------------------------------------------------------------------
# Logprobs
# ------------------------------------------------------------------------------------------------
def test_logprobs_are_raw_and_topk_sorted():
    torch.manual_seed(7)
    S, V = 8, 700
    logits = torch.randn(S, V) * 3
    params = [SP(temperature=0, logprobs=3), SP(temperature=0.5, logprobs=5), SP(logprobs=0),
              SP(top_k=5, repetition_penalty=1.5), SP(temperature=2.0, top_p=0.5, logprobs=2),
              SP(temperature=0), SP(min_p=0.2, logprobs=1), SP(frequency_penalty=1.0)]
    outputs = [[int(logits[i].argmax())] * 3 for i in range(S)]
    b = build(params, outputs=outputs, vocab=V)
    assert b.max_logprobs == 5
    out = Sampler()(logits, b)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.token_ids[:, None])[:, 0], rtol=0, atol=1e-5)
    assert out.topk_ids.shape == (S, 5) and out.topk_logprobs.shape == (S, 5)
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()
    ref_vals, ref_ids = ref.topk(5, -1)
    assert torch.equal(out.topk_ids, ref_ids)
    torch.testing.assert_close(out.topk_logprobs.double(), ref_vals, rtol=0, atol=1e-5)
    # no logprobs requested: no top list, sampled logprob still there
    b0 = build([SP()] * S, vocab=V)
    out0 = Sampler()(logits, b0)
    assert out0.topk_ids is None and out0.topk_logprobs is None
    torch.testing.assert_close(out0.logprobs.double(), ref.gather(1, out0.token_ids[:, None])[:, 0], rtol=0, atol=1e-5)


def test_batch_flags_and_device_placement():
    V = 100
    b = build([SP(temperature=0)] * 3, vocab=V)
    assert b.all_greedy and b.no_penalties and b.no_top_k_top_p and b.min_tokens_rows is None and b.output_ids is None
    b = build([SP(temperature=0), SP(top_k=10), SP(top_p=0.5, top_k=V + 5)], vocab=V)
    assert not b.all_greedy and not b.all_random and b.random_rows.tolist() == [1, 2]
    assert b.use_top_p and b.top_k.tolist() == [0, 10, 0] and b.top_k_max == 10
    assert b.top_k_top_p_rows is None and b.no_min_p
    b = build([SP(), SP(top_k=3)], vocab=V)
    assert b.top_k_top_p_rows.tolist() == [1] and not b.use_top_p
    b = build([SP(), SP(repetition_penalty=1.2), SP(presence_penalty=0.5)], outputs=[[1], [2, 3], []], vocab=V)
    assert b.penalty_rows.tolist() == [1, 2] and b.prompt_ids.shape[0] == 2
    assert b.output_ids.tolist() == [[2, 3], [V, V]]
