"""AWQ checkpoints (AutoAWQ GEMM layout, `quant_method: awq`, `version: gemm`): qweight / qzeros / scales.

Layout: qweight int32 [in, out / 8], the output dimension packed eight 4-bit values a word in the interleaved order
[0, 2, 4, 6, 1, 3, 5, 7] (the value at bit shift 4 * i is output column 8 * word + ORDER[i]); qzeros int32
[in / group_size, out / 8] packed the same way, unsigned zero points stored as they are; scales [groups, out].
w[o, j] = (q[j, o] - zero[j // group_size, o]) * scales[j // group_size, o].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.models.quant.base import QuantMethod, fail, need, read_int
from loom.models.quant.gptq import group_size
from loom.models.quant.weight import QuantizedWeight, meta_weight, num_groups, pack_int32, unpack_int32

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE_ORDER = tuple(ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class Awq(QuantMethod):
    group_size: int | None
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert: names of modules the checkpoint keeps in float

    marker = "qweight"
    components = frozenset({"qweight", "qzeros", "scales"})

    @classmethod
    def parse(cls, q: dict) -> "Awq":
        read_int(q, "bits", (4,), "4-bit AWQ")
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise fail("version", f"{q.get('version')!r} is not supported; loom loads AWQ's GEMM layout")
        if not q.get("zero_point", True):
            raise fail("zero_point", "false is not supported; loom loads AWQ with zero points")
        return cls(group_size(q, "group_size"), tuple(q.get("modules_to_not_convert") or ()))

    def quantizes(self, module: str) -> bool:
        return not any(m in module for m in self.not_converted)

    def layout(self, module: str, shape: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
        n = num_groups(shape[1], self.group_size)
        return meta_weight(shape, "int", 4, (shape[0], n), torch.float16, zero=True, group_size=self.group_size)

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, scales = need(module, tensors, "qweight"), need(module, tensors, "scales")
        out, inp = scales.shape[-1], qweight.shape[0]
        q = deinterleave(qweight, out)
        zeros = deinterleave(need(module, tensors, "qzeros"), out)
        return QuantizedWeight(shape=(out, inp), kind="int", bits=4, weight=pack_int32(q.t(), 4),
                               scale=scales.t().contiguous(), zero=zeros.t().contiguous(), group_size=self.group_size)


def deinterleave(packed: torch.Tensor, out: int) -> torch.Tensor:
    """int32 [rows, out / 8] in AWQ order -> unsigned 4-bit values [rows, out] in column order."""
    vals = unpack_int32(packed, 4, packed.shape[-1] * 8)
    index = (torch.arange(vals.shape[-1]).view(-1, 8)[:, list(REVERSE_ORDER)]).flatten()
    return vals[:, index][:, :out]
