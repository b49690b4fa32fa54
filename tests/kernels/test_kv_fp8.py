"""The fp8 KV cache's e4m3 codec (kernels/kv_fp8.py) against a direct float64 computation of the format: decode of
all 256 codes; encode (reference and the Triton functions the KV kernels inline, under the interpreter) of every
code's value, every rounding midpoint and its neighbours, out-of-range and NaN inputs, and random values at scales."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from loom.kernels.kv_fp8 import FP8_MAX, codec_triton, decode_ref, encode_ref, inv_scale


def e4m3_value(code: int) -> float:
    """The format's definition: sign, exponent field e (bias 7), mantissa m; e = 0 subnormal; 0x7f / 0xff NaN."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    v = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


CODES = list(range(256))
VALUES = np.array([e4m3_value(c) for c in CODES])
FINITE = np.array(sorted({v for v in VALUES if not math.isnan(v)}))  # -0.0 and 0.0 collapse: same value


def nearest_even_code(x: float) -> int:
    """The oracle encode in float64: saturate to +-448, the nearest finite value, ties to the even mantissa (the
    code's lowest bit), the sign kept for zero and NaN."""
    neg = math.copysign(1.0, x) < 0
    if math.isnan(x):
        return 0xFF if neg else 0x7F
    a = min(abs(x), FP8_MAX)
    pos = [c for c in range(0x7F)]  # the non-negative finite codes, increasing in value
    d = [abs(VALUES[c] - a) for c in pos]
    best = min(d)
    ties = [c for c, di in zip(pos, d) if di == best]
    c = ties[0] if len(ties) == 1 else next(t for t in ties if t % 2 == 0)
    return c | (0x80 if neg else 0)


def _inputs() -> np.ndarray:
    """Every finite value, the midpoints between neighbours and the float32 values either side of each, beyond the
    range, tiny values, NaN."""
    pos = FINITE[FINITE >= 0]
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32 (4 significant bits)
    mids32 = mids.astype(np.float32)
    up, down = np.nextafter(mids32, np.float32(np.inf)), np.nextafter(mids32, np.float32(0))
    extra = np.array([449.0, 464.0, 480.0, 1e4, 3.4e38, 2.0 ** -10, 2.0 ** -12, 1e-30, 0.0], np.float32)
    x = np.concatenate([pos.astype(np.float32), mids32, up, down, extra])
    return np.concatenate([x, -x, np.array([np.nan, -np.nan], np.float32)]).astype(np.float32)


def test_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_ref(codes).double().numpy()
    _, tri = codec_triton(torch.zeros(256), codes)
    np.testing.assert_array_equal(got, VALUES)  # NaN where NaN
    np.testing.assert_array_equal(tri.double().numpy(), VALUES)
    assert np.array_equal(np.signbit(got[[0, 128]]), [False, True])  # +-0 keep their sign


def test_encode_rounds_to_nearest_even_and_saturates():
    x = _inputs()
    want = np.array([nearest_even_code(float(v)) for v in x], dtype=np.uint8)
    got = encode_ref(torch.from_numpy(x)).numpy()
    tri, _ = codec_triton(torch.from_numpy(x), torch.zeros(len(x), dtype=torch.uint8))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tri.numpy(), want)


@pytest.mark.parametrize("scale", [1.0, 0.037, 3.5])
def test_scaled_values_encode_as_the_reference(scale):
    """Random values over the whole range (and past it) at a checkpoint-like scale: the codes are the oracle's for
    x * float32(1 / scale), the decoded value is the code's value times the scale, within e4m3's half-ulp bound."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * torch.exp2(torch.randint(-12, 10, (4096,), generator=g).float())) * scale
    x32 = x.numpy().astype(np.float32)
    scaled = (x32 * np.float32(inv_scale(scale))).astype(np.float32)
    want = np.array([nearest_even_code(float(v)) for v in scaled], dtype=np.uint8)
    tri, dec = codec_triton(x, torch.from_numpy(want), scale)
    np.testing.assert_array_equal(encode_ref(x, scale).numpy(), want)
    np.testing.assert_array_equal(tri.numpy(), want)
    np.testing.assert_array_equal(dec.numpy(), decode_ref(torch.from_numpy(want), scale).numpy())
    # |decode - x| <= half an ulp of e4m3 (2^-4 relative for normals, 2^-10 absolute below 2^-6), times the scale
    ok = np.abs(scaled) <= FP8_MAX
    err = np.abs(VALUES[want].astype(np.float64) - scaled.astype(np.float64))[ok]
    bound = np.maximum(np.abs(scaled[ok]) * 2.0 ** -4, 2.0 ** -10) * (1 + 1e-6)
    assert (err <= bound).all()
