"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`): qweight / qzeros / scales / g_idx per linear.

Layout (AutoGPTQ's pack): qweight int32 [in * bits / 32, out], the input dimension packed, element j of a word at
bit shift bits * j; qzeros int32 [groups, out * bits / 32], the output dimension packed the same way; scales
[groups, out]; g_idx int32 [in], the group of each input column (a permutation of the plain j // group_size when
the checkpoint was made with desc_act). The "gptq" (v1) checkpoint format stores each zero point minus one (so a
symmetric 4-bit checkpoint holds 7 and means 8); "gptq_v2" (GPTQModel) stores it as is.
w[o, j] = (q[j, o] - zero[g_idx[j], o]) * scales[g_idx[j], o].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.models.quant.base import QuantMethod, fail, need, read_int
from loom.models.quant.weight import QuantizedWeight, meta_weight, num_groups, unpack_int32

FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to each stored zero point


@dataclass(frozen=True)
class Gptq(QuantMethod):
    bits: int
    group_size: int | None  # None: one group per output channel (group_size -1)
    desc_act: bool
    sym: bool
    zero_offset: int

    marker = "qweight"
    components = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    @classmethod
    def parse(cls, q: dict) -> "Gptq":
        bits = read_int(q, "bits", (4, 8), "4-bit (and 8-bit) GPTQ; other widths need other kernels")
        fmt = q.get("checkpoint_format") or "gptq"
        if fmt not in FORMATS:
            raise fail("checkpoint_format", f"{fmt!r} is not supported; loom loads {' and '.join(FORMATS)}")
        return cls(bits, group_size(q, "group_size"), bool(q.get("desc_act", False)), bool(q.get("sym", True)),
                   FORMATS[fmt])

    def layout(self, module: str, shape: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
        n = num_groups(shape[1], self.group_size)  # float16 scales; zero points always stored (read as they are)
        return meta_weight(shape, "int", self.bits, (shape[0], n), torch.float16, zero=True,
                           group_size=self.group_size, act_order=self.desc_act)

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, scales = need(module, tensors, "qweight"), need(module, tensors, "scales")
        out = scales.shape[-1]
        inp = qweight.shape[0] * 32 // self.bits
        zeros = unpack_int32(need(module, tensors, "qzeros"), self.bits, out) + self.zero_offset
        g_idx = tensors.get("g_idx")
        return QuantizedWeight(shape=(out, inp), kind="int", bits=self.bits, weight=qweight.t().contiguous(),
                               scale=scales.t().contiguous(), zero=zeros.t().contiguous(),
                               group_size=self.group_size, g_idx=act_order(g_idx, inp, self.group_size))


def group_size(q: dict, key: str) -> int | None:
    gs = q.get(key, -1)
    if not isinstance(gs, int) or not (gs == -1 or gs > 0):
        raise fail(key, f"{gs!r} is not supported (a positive group size, or -1 for one group per channel)")
    return None if gs == -1 else gs


def act_order(g_idx: torch.Tensor | None, inp: int, size: int | None) -> torch.Tensor | None:
    """The group index of each input column if it is not the plain j // group_size, else None."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int32)
    plain = torch.arange(inp, dtype=torch.int32) // size if size else torch.zeros(inp, dtype=torch.int32)
    return None if g_idx.shape == plain.shape and torch.equal(g_idx, plain) else g_idx
