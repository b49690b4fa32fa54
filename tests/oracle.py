"""Tolerances derived from a float64 oracle, not constants tuned on one machine.

A float32 implementation of some math is judged by its distance from the float64 value of the same math, against
the distance of an independent float32 evaluation of it (the reference: transformers, PyTorch) from that value. The
reference's own error measures how well-conditioned the computation is on the machine at hand: an adapter that
drives the residual stream to |h| ~ 1e3 makes every float32 evaluation order land ~1e-4 from float64 in logprob,
while a tame one lands ~1e-6. Independent float32 orders of the same math were seen up to ~7x apart in their
distance from float64 (tests/models, AMD Zen 5 and Intel Xeon), so an implementation within FACTOR = 16 times the
reference's error is float32 arithmetic, and one beyond it is a bug. One ulp of the largest value is the least
the reference's error is taken to be (a reference that rounds exactly by luck must not demand zero).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

EPS32 = torch.finfo(torch.float32).eps
FACTOR = 16.0


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64).detach().cpu()


def float32_error_scale(ref32, ref64) -> float:
    """The float32 reference's largest distance from float64 over these values, at least one ulp of the largest."""
    ref32, ref64 = _f64(ref32), _f64(ref64)
    return max(float((ref32 - ref64).abs().max()), EPS32 * float(ref64.abs().max()))


def assert_float32_close(got, ref64, scale: float, what: str, factor: float = FACTOR) -> None:
    """|got - ref64| <= factor * scale (scale: float32_error_scale of the reference over the same computation)."""
    err = float((_f64(got) - _f64(ref64)).abs().max())
    assert err <= factor * scale, (f"{what}: {err:.3g} from float64, more than {factor:g}x the float32 reference's "
                                   f"own {scale:.3g}")


def pooled_scales(ref32s: Sequence, ref64s: Sequence, keys: Sequence) -> dict:
    """float32_error_scale per key over every value of that key (e.g. all prompts run through one oracle model): one
    prompt's few positions are a noisy sample of the computation's conditioning, the check's whole set less so."""
    scales: dict = {}
    for r32, r64, key in zip(ref32s, ref64s, keys):
        scales[key] = max(scales.get(key, 0.0), float32_error_scale(r32, r64))
    return scales


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers (+ PEFT) model; MoE experts run eagerly (grouped_mm has no float64)."""
    twin = copy.deepcopy(model).double()
    base = twin.get_base_model() if hasattr(twin, "get_base_model") else twin
    if getattr(base.config, "_experts_implementation", None) not in (None, "eager"):
        base.set_experts_implementation("eager")
    return twin


@torch.no_grad()
def log_softmax_32_64(model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax of the logits at every position of ids: the model in float32, and its float64 twin."""
    x = torch.tensor([ids])
    lsm32 = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
    lsm64 = torch.log_softmax(float64_twin(model)(input_ids=x).logits[0].double(), -1)
    return lsm32, lsm64
