"""The sampler's randomness: a counter-based uniform per row and the inverse-CDF draw from it.

Random draw: inverse CDF with a counter-based uniform.  Each row gets one ``u = hash(seed, step)``
in (0, 1) from a splitmix64-style hash computed with int64 tensor arithmetic (multiplication wraps
modulo 2^64, logical right shifts are emulated by masking); the token is the first id (in vocabulary
order) whose float64 cumulative probability under the processed distribution exceeds ``u``.  The draw
of a row therefore only depends on its own logits, parameters, seed and step (number of output
tokens so far): the same seed gives the same text whatever else is in the batch, and no
per-sequence ``torch.Generator`` is needed.  (A Gumbel-max race with per-token hashed noise was
measured at ~60-110 ms per call for S=32, V=49152 on one CPU thread; one uniform per row plus a
two-level cumsum costs a few ms and is exact as well.)

Used by loom.engine.sample.sampler on the logits the filters (loom.engine.sample.sampling_filters) left.
"""
from __future__ import annotations

import torch
from torch import Tensor


# ----------------------------------------------------------------------------------------------
# Counter-based random numbers (splitmix64 finaliser in int64 torch arithmetic)
# ----------------------------------------------------------------------------------------------
def _as_i64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


GOLDEN = _as_i64(0x9E3779B97F4A7C15)
_MIX_C1 = _as_i64(0xBF58476D1CE4E5B9)
_MIX_C2 = _as_i64(0x94D049BB133111EB)
_U52 = (1 << 52) - 1


def _lsr(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on int64)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors, bit-identical to the uint64 version (a bijection)."""
    z = z ^ _lsr(z, 30)
    z = z * _MIX_C1
    z ^= _lsr(z, 27)
    z *= _MIX_C2
    z ^= _lsr(z, 31)
    return z


def row_keys(seeds: Tensor, steps: Tensor) -> Tensor:
    """Per-row stream key from (seed, step): mix(mix(seed) + (step + 1) * GOLDEN)."""
    return mix64(mix64(seeds) + (steps + 1) * GOLDEN)


def counter_uniform(seeds: Tensor, steps: Tensor) -> Tensor:
    """One uniform per row in (0, 1), float64, a function of (seeds[s], steps[s]) only: top 52 bits of the key."""
    return (_lsr(row_keys(seeds, steps), 12).to(torch.float64) + 0.5) * (2.0 ** -52)


# ----------------------------------------------------------------------------------------------
# Inverse-CDF draw
# ----------------------------------------------------------------------------------------------
CDF_BLOCK = 256  # inverse-CDF search is two-level: block sums, then a cumsum inside the chosen block


def sample_from_logits(logits: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: for each row the first token (in id order) whose cumulative probability exceeds ``u`` [R].

    ``logits`` [R, V] may hold -inf for masked tokens (never drawn); ``u`` float64 in (0, 1).  Two-level
    search so that only one full pass (exp + float32 sums of blocks of ``CDF_BLOCK`` tokens) touches the
    whole vocabulary: block CDF in float64, then a float64 cumsum inside the chosen block.  Tiny
    probabilities keep their share (no float32 cumulative sum over the vocabulary is formed).
    """
    R, V = logits.shape
    B = CDF_BLOCK
    nb = -(-V // B)
    w = (logits - logits.amax(dim=-1, keepdim=True)).exp_()  # [R, V], 0 where masked
    if nb * B != V:
        w = torch.nn.functional.pad(w, (0, nb * B - V))
    w = w.view(R, nb, B)
    block_cdf = w.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)  # [R, nb]; float32 sums of B terms
    target = u[:, None] * block_cdf[:, -1:]
    blk = torch.searchsorted(block_cdf, target, right=True).clamp_(max=nb - 1)  # [R, 1]
    before = block_cdf.gather(1, (blk - 1).clamp(min=0))
    before = torch.where(blk > 0, before, torch.zeros_like(before))
    inner = w.gather(1, blk[:, :, None].expand(R, 1, B)).squeeze(1).to(torch.float64).cumsum_(dim=-1)  # [R, B]
    total = inner[:, -1:]
    # rounding guard: stay strictly below the block's total so the pick is a token of positive weight
    t = torch.minimum((target - before).clamp_(min=0), torch.nextafter(total, torch.zeros_like(total)))
    off = torch.searchsorted(inner, t, right=True).clamp_(max=B - 1)
    return (blk * B + off).squeeze(1)
