"""y = x @ W^T + b on CPU over a copy of W packed once for the C++ GEMM (kernels/cpu_ext.py).

The weights of a decode step are streamed from memory once per step and each multiplies a few tens of rows:
MKL's sgemm re-packs W at every call, oneDNN's pre-packed GEMM does not, and this kernel also prefetches the
next weight panel while the current one is in use (measured on the project's 2-core AMD EPYC, one thread, all
GEMMs of a SmolLM2 decode step of 32 rows: about 1.25-1.6x oneDNN's pre-packed GEMM, which itself beats
MKL's by about 1.3x). Float32 only; the reference is F.linear. A bfloat16 model's linear layers run oneDNN's
prepacked bfloat16 GEMM instead (PrepackedBf16, below: ~2x a float32 GEMM over the same weights). Under
torch.compile it is the opaque op `loom::linear_packed`.
"""
from __future__ import annotations

from typing import Optional

import torch

from loom.kernels import cpu_ext, torch_ops

# A prefill chunk's x [tokens, K] above BLOCK_ABOVE_BYTES does not stay in the last-level cache beside the weights
# while every weight panel passes over it: the GEMM then takes its rows in blocks of ROW_BLOCK_BYTES, which stay in L2.
# A block re-reads the weights where one block re-reads x once per panel: blocks of fewer than MIN_BLOCK_ROWS rows (K
# above ~1,600) re-read too much. Measured on the project's 2-core EPYC (512 KiB L2 a core, 32 MiB L3), one thread,
# 2,048 tokens, blocked / one block: the default model's q|k|v, o, gate|up 0.67-0.98 and down (K 1,536) 0.73-0.87;
# other shapes 0.78-0.94 with blocks of 42-113 rows (weights of 8-38 MB), 0.92-1.09 with 32, 1.20-1.31 with 25 and
# 1.32 with 16; 1,024 tokens: down 0.86; 512 tokens: no gain.
BLOCK_ABOVE_BYTES = 4 << 20
MIN_BLOCK_ROWS = 40
ROW_BLOCK_BYTES = 256 << 10


class PackedWeight:
    """W [N, K] float32 re-laid-out as panels [ceil(N / P), K, P], P = panel_width() (24 with AVX2, 48 with AVX-512);
    holds a second copy of W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """out: float32 memory for the panels (at least panels_numel(*weight.shape) elements; e.g. a slice of one
        buffer for all of a model's weights, kernels/cpu_memory.py), else a buffer of its own."""
        lib = cpu_ext.load()
        if lib is None or not cpu_ext.usable(weight):
            raise ValueError("the C++ GEMM needs a float32 CPU weight and the built CPU kernels")
        w = weight.detach().contiguous()
        self.out_features, self.in_features = w.shape
        n = self.panels_numel(self.out_features, self.in_features)
        if out is None:
            self.panels = torch.empty(n)
        elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < n:
            raise ValueError(f"out must be a contiguous float32 tensor of at least {n} elements")
        else:
            self.panels = out.view(-1)[:n]
        lib.loom_gemm_pack(w.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        # bound once: the library that packed the panels, and the LoRA path (kernels/cpu_lora.py imports this
        # module), so that the ~120 calls of a decode step do not look them up: with_lora at 32 x 8 x 48, one
        # thread 11.9 -> 8.8 us a call, two 15.4 -> 10.2
        from loom.kernels.cpu_lora import linear_lora_cpu

        self.lib, self._linear_lora = lib, linear_lora_cpu

    @staticmethod
    def panels_numel(out_features: int, in_features: int) -> int:
        p = panel_width()
        return -(-out_features // p) * p * in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op (the panels are a plain tensor: no freezing needed)
            return torch.ops.loom.linear_packed(x, self.panels, self.bias, self.out_features)
        return gemm(self.lib, x, self.panels, self.bias, self.out_features)

    def with_lora(self, x, lora_a, lora_b, slice_offsets, meta) -> torch.Tensor:
        """self(x) plus the step's LoRA deltas (eager), added to the GEMM's output tiles (kernels/cpu_lora.py)."""
        return self._linear_lora(x, self.panels, self.bias, self.out_features, lora_a, lora_b, slice_offsets, meta,
                                 self.lib)


def panel_width() -> int:
    """Columns per packed panel: the register tile's width in the library this machine builds."""
    return cpu_ext.built().loom_gemm_panel_width()


def block_rows(k: int) -> int:
    """Rows of x [., k] float32 per block once it is blocked at all (0: blocks would be too thin to pay)."""
    rows = ROW_BLOCK_BYTES // (4 * k)
    return rows if rows >= MIN_BLOCK_ROWS else 0


def row_block(m: int, k: int) -> int:
    """Rows per block of the GEMM over x [m, k] float32 (0: one block); the result does not depend on it."""
    return block_rows(k) if m * k * 4 > BLOCK_ABOVE_BYTES else 0


def linear_packed(x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor],
                  out_features: int) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] with W packed into `panels` (PackedWeight)."""
    return gemm(cpu_ext.built(), x, panels, bias, out_features)


def gemm(lib, x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """linear_packed with the library that packed the panels given."""
    shape = x.shape
    flat = len(shape) == 2  # the engine's [tokens, features]: no reshape or view (~7 us a call, ~120 calls a step)
    x2 = x if flat else x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1 or x2.dtype != torch.float32:
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    y = torch.empty((m, out_features), dtype=torch.float32)
    if m:
        lib.loom_gemm(x2.data_ptr(), x2.stride(0), m, shape[-1], panels.data_ptr(), out_features,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
                      row_block(m, shape[-1]), cpu_ext.nthreads())
    return y if flat else y.view(*shape[:-1], out_features)


torch_ops.define("linear_packed(Tensor x, Tensor panels, Tensor? bias, SymInt out_features) -> Tensor", linear_packed,
                 lambda x, panels, bias, out_features: x.new_empty((*x.shape[:-1], out_features)))


def onednn_bf16() -> bool:
    """Whether torch's oneDNN runs bfloat16 GEMMs on this CPU's own 16-bit units (avx512_bf16 / AMX; AVX-512
    cores without them it emulates, still ahead of F.linear's per-call re-pack), the condition for PrepackedBf16."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PrepackedBf16:
    """y = x @ W^T + b for a bfloat16 W re-laid-out once, at load, into oneDNN's blocked format
    (torch.ops.mkldnn._reorder_linear_weight), then run by oneDNN's prepacked linear, which dispatches to AMX or
    avx512_bf16 dot products with float32 accumulation (each output rounded once to bfloat16, as F.linear).
    F.linear re-lays the weight out at every call. Measured on the project's Zen 5 (avx512_bf16, no AMX), one
    thread, prepacked / F.linear: default model's four linears 0.48-0.92 at 1-32 rows, 0.95-1.05 at 512; its
    lm_head 0.56-0.76; a 1B-class model's (2,048 / 8,192 wide) 0.39-0.82, 0.97 at 512; and 0.36-0.82 of the float32
    C++ GEMM's time at the same shapes. Holds a second copy of W (the module keeps its own:
    lm_head's may be the tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if not (weight.is_cpu and weight.dtype == torch.bfloat16 and weight.dim() == 2):
            raise ValueError("PrepackedBf16 takes a 2-D bfloat16 CPU weight")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def loom_bf16_gemm(lib=None) -> bool:
    """Whether loom's bfloat16 GEMM (kernels/csrc/gemm_bf16.cpp, VDPBF16PS) runs here: the CPU has avx512_bf16 and
    the library was built with it (a compiler that takes the target)."""
    lib = lib or cpu_ext.load()
    return lib is not None and {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_ext.cpu_flags() \
        and bool(lib.loom_gemm_bf16_built())


class PackedBf16:
    """y = x @ W^T + b for a bfloat16 W packed once, at load, into loom's VDPBF16PS panels (kernels/csrc/gemm_bf16.cpp:
    [ceil(N / 48), ceil(K / 2), 48, 2]), float32 accumulation, each output rounded once to bfloat16 (float32 with
    out_f32: logits). Only where loom_bf16_gemm(); holds a second copy of W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, out_f32: bool = False):
        lib = cpu_ext.load()
        if not (weight.is_cpu and weight.dtype == torch.bfloat16 and weight.dim() == 2) or not loom_bf16_gemm(lib):
            raise ValueError("PackedBf16 takes a 2-D bfloat16 CPU weight on a CPU with avx512_bf16")
        w = weight.detach().contiguous()
        self.out_features, self.in_features = w.shape
        nr = lib.loom_gemm_bf16_panel_width()
        self.panels = torch.empty(-(-self.out_features // nr) * nr * (-(-self.in_features // 2) * 2),
                                  dtype=torch.bfloat16)
        lib.loom_gemm_bf16_pack(w.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_dtype = torch.float32 if out_f32 else torch.bfloat16
        self.lib = lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if len(shape) == 2 else x.reshape(-1, shape[-1])
        if x2.dtype != torch.bfloat16 or x2.stride(-1) != 1:
            x2 = x2.to(torch.bfloat16).contiguous()
        m = x2.shape[0]
        y = torch.empty((m, self.out_features), dtype=self.out_dtype)
        if m:
            self.lib.loom_gemm_bf16(x2.data_ptr(), x2.stride(0), m, self.in_features, self.panels.data_ptr(),
                                    self.out_features, None if self.bias is None else self.bias.data_ptr(),
                                    y.data_ptr(), y.stride(0), int(self.out_dtype == torch.float32),
                                    cpu_ext.nthreads())
        return y if len(shape) == 2 else y.view(*shape[:-1], self.out_features)
