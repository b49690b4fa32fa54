"""What runs on CPU and how: the set-up the engine applies at its start (not at import: importing loom has no side
effects). model_runner calls set_up_process (the number of compute threads, MKL's instruction set on AMD, malloc's
reuse of freed activations), then decides the kernel path (kernels/policy.py: Triton, the C++ kernels or the
references, whether weights are packed and the layer pass runs) and applies it here (apply_path: the linear layers'
and MoE experts' GEMMs over packed weights - float32: the C++ GEMM's panels; bfloat16: oneDNN's prepacked layout -,
each decoder layer in one C++ call, models/layer_pass.py; a quantized checkpoint's linear layers: their weights
re-laid out for the C++ weight-only GEMM, pack_quantized_weights).

Elsewhere, by layer: each op's choice per call is kernels/dispatch.py; the C++ library's build and the OpenMP
helpers for threads beside the compute thread (serial_thread, on_a_passing_thread; lora/ uses them) are
kernels/cpu_ext.py."""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger("loom")


def tune_mkl_for_amd() -> None:
    """MKL's AVX-512 GEMM path is pathologically slow for small-M matmuls on AMD EPYC CPUs that have AVX-512
    (Zen 4: 16 ms vs 0.18 ms for an fp32 [8,1536]x[1536,576] matmul); its AVX2 kernels are the fast ones there.
    MKL reads the variable once, when it first dispatches a GEMM, not when torch loads it: calling this after
    `import torch` works as long as no matmul ran yet.
    The engine calls it at its start; entry points that run torch work first (benchmarks with HF peers,
    tests) call it before that work. A user's own setting always wins."""
    if "MKL_ENABLE_INSTRUCTIONS" in os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            amd = "AuthenticAMD" in f.read(4096)
    except OSError:
        return
    if amd:
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit systems


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse instead of returning them to the system. A
    step's activations (a 2,048-token prefill chunk's gate|up output is 25 MB, a decode step's logits 6 MB) are
    allocated and freed layer after layer; by default glibc maps large ones afresh and trims the heap, so steps
    page-fault and zero them again and again: the default model, 32 requests of 64 prompt tokens and 32 new
    tokens, two threads: 23,000-56,000 page faults a batch, ~10% of the CPU time in the kernel; with this ~0, and
    342-373 -> 392-450 tokens/s. Process-wide, as the thread count is; the heap then stays at its peak. False
    (nothing changed) where malloc is not glibc's."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cgroup cpusets, Triton's instance groups)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compute_threads(requested: int) -> int:
    """requested > 0: that many; 0: torch's current count (its default is the cores it saw at start). Either
    way at most the cores available now: more threads than cores only time-slice, and every OpenMP barrier then
    waits for a descheduled thread (several times slower)."""
    cores = available_cores()
    n = requested if requested > 0 else torch.get_num_threads()
    if requested > cores:
        log.warning("cpu_threads=%d is more than the %d cores available to this process: using %d",
                    requested, cores, cores)
    return max(1, min(n, cores))


def serving_threads(instances: int = 1) -> int:
    """Default inside a server: the available cores, shared between the model's instances; at least 1. None is
    kept back for the server's own threads (gRPC, the stub, the senders), which need little CPU: with the engine's
    OpenMP team the process's only one (cpu_ext.serial_thread, on_a_passing_thread), the default model on 2 cores
    with 2 threads against 1 in the server: 1.38x / 1.22x / 1.23x output tokens/s at concurrency 1 / 16 / 64,
    lower TTFT and ITL at every percentile (docs/BENCHMARKS.md)."""
    return max(1, available_cores() // max(1, instances))


def set_compute_threads(requested: int) -> int:
    n = compute_threads(requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def set_up_process(cpu_threads: int) -> int:
    """The process-wide CPU settings, before the C++ kernels load; returns the compute threads."""
    tune_mkl_for_amd()
    threads = set_compute_threads(cpu_threads)
    keep_freed_memory()
    return threads


def apply_path(model: nn.Module, path) -> None:
    """Packs the weights and sets the layer pass as `path` (kernels/policy.KernelPath) says; nothing where it packs
    nothing (CUDA, the references)."""
    import time

    from loom.kernels.policy import CPU, GEMM_LOOM_BF16, GEMM_ONEDNN

    t = time.perf_counter()
    if path.quant == CPU:
        n, nbytes, bf16 = pack_quantized_weights(model)
        if n:
            log.info("re-laid out %d quantized linear layers' weights (%.1f MB) for the C++ weight-only GEMM in "
                     "%.2fs%s", n, nbytes / 1e6, time.perf_counter() - t,
                     f" ({bf16} parts for the bfloat16 one, VDPBF16PS)" if bf16 else "")
    if not path.packed:
        return
    t = time.perf_counter()
    if path.gemm == GEMM_ONEDNN:
        n, how = pack_linear_weights_bf16(model, loom=False), "oneDNN's prepacked bfloat16 layout"
    elif path.gemm == GEMM_LOOM_BF16:
        n, how = pack_linear_weights_bf16(model, loom=True, experts=path.packed_experts), \
            "loom's bfloat16 GEMM (VDPBF16PS panels)"
    else:
        n, how = pack_linear_weights(model, experts=path.packed_experts), "the C++ GEMM's panels"
    log.info("packed %d linear layers' weights for %s in %.2fs", n, how, time.perf_counter() - t)
    decoder = getattr(model, "model", None)
    if path.layer_pass and hasattr(decoder, "layer_pass"):
        from loom.models.layer_pass import LayerPass

        decoder.layer_pass = LayerPass()  # each decoder layer in one C++ call


def pack_linear_weights(model: nn.Module, experts: bool = True) -> int:
    """Route every linear layer of a CPU float32 model through the C++ GEMM over packed weights
    (kernels/cpu_linear.py): LoRALinear via its `dense` hook, plain nn.Linear (lm_head, MoE routers) via its
    forward, MoE experts (with `experts`) via their `dense` hook (kernels/cpu_moe.py). Returns how many modules were
    packed; each holds a second, packed copy of its weights, all of them in one buffer on huge pages
    (kernels/cpu_memory.py: a decode step streams every one of them)."""
    from loom.kernels.cpu_linear import PackedWeight
    from loom.kernels.cpu_memory import empty_on_huge_pages
    from loom.kernels.cpu_moe import PackedExperts
    from loom.layers.linear import LoRALinear
    from loom.layers.moe import Experts

    def numel(mod) -> int:
        if isinstance(mod, Experts):
            return PackedExperts.numel(mod.gate_up_proj.shape, mod.down_proj.shape)
        return PackedWeight.panels_numel(*mod.weight.shape)

    from loom.layers.quant_linear import QuantLinear

    kinds = (LoRALinear, nn.Linear, Experts) if experts else (LoRALinear, nn.Linear)
    mods = [mod for mod in model.modules() if isinstance(mod, kinds) and not isinstance(mod, QuantLinear)]
    sizes = [-(-numel(mod) // 16) * 16 for mod in mods]  # each module's panels start on a cache line (16 floats)
    arena = empty_on_huge_pages((sum(sizes),))
    start = 0
    for mod, size in zip(mods, sizes):
        out = arena[start:start + size]
        start += size
        if isinstance(mod, Experts):
            mod.dense = PackedExperts(mod.gate_up_proj, mod.down_proj, out=out)
        elif isinstance(mod, LoRALinear):
            mod.dense = PackedWeight(mod.weight, mod.bias, out=out)
        else:
            mod.forward = PackedWeight(mod.weight, mod.bias, out=out)
    return len(mods)


def pack_linear_weights_bf16(model: nn.Module, loom: bool, experts: bool = False) -> int:
    """Route every linear layer of a CPU bfloat16 model through a bfloat16 GEMM over weights re-laid out once here:
    loom's (kernels/cpu_linear.PackedBf16, VDPBF16PS panels) with `loom`, else oneDNN's prepacked one
    (kernels/cpu_linear.PrepackedBf16): LoRALinear via its `dense` hook (its LoRA then runs after it, on the PyTorch
    path), plain nn.Linear (lm_head, MoE routers) via its forward; MoE experts (with `loom` and `experts`) via their
    `dense` hook (kernels/cpu_moe.PackedExpertsBf16), else their PyTorch path. Returns how many modules were packed;
    each holds a second, packed copy of its weights."""
    from loom.kernels.cpu_linear import PackedBf16, PrepackedBf16
    from loom.kernels.cpu_moe import PackedExpertsBf16
    from loom.layers.linear import LoRALinear
    from loom.layers.moe import Experts
    from loom.layers.quant_linear import QuantLinear

    n = 0
    for mod in model.modules():
        if loom and experts and isinstance(mod, Experts) and mod.gate_up_proj.dtype == torch.bfloat16:
            mod.dense = PackedExpertsBf16(mod.gate_up_proj, mod.down_proj)
            n += 1
            continue
        if not isinstance(mod, (LoRALinear, nn.Linear)) or isinstance(mod, QuantLinear) or \
                mod.weight.dtype != torch.bfloat16:
            continue
        packed = (PackedBf16 if loom else PrepackedBf16)(mod.weight, mod.bias)
        if isinstance(mod, LoRALinear):
            mod.dense = packed
        else:
            mod.forward = packed
        n += 1
    return n


def pack_quantized_weights(model: nn.Module) -> tuple[int, int, int]:
    """Re-lay out the quantized weights of every QuantLinear (layers/quant_linear.py) and QuantExperts
    (layers/quant_experts.py) for the C++ weight-only GEMM
    (kernels/cpu_quant.PackedQuantWeight), dropping the checkpoint-layout copy; a part the kernel does not take
    keeps its QuantizedWeight (the reference runs it). A bfloat16 model's QuantLinear parts go to the bfloat16 kernel
    (kernels/cpu_quant_bf16.PackedQuantBf16, VDPBF16PS) where the CPU has avx512_bf16 and the part is one it takes.
    Returns (layers re-laid out, bytes of their panels, parts on the bfloat16 kernel)."""
    from loom.kernels import cpu_quant_bf16
    from loom.kernels.cpu_quant import PackedQuantWeight, takes
    from loom.layers.quant_experts import QuantExperts
    from loom.layers.quant_linear import QuantLinear
    from loom.models.quant.weight import QuantizedWeight

    n, nbytes, on_bf16 = 0, 0, 0
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    bf16 = dtype == torch.bfloat16 and cpu_quant_bf16.runs_here()

    def pack(w, linear: bool):
        nonlocal nbytes, on_bf16
        if not isinstance(w, QuantizedWeight):
            return w
        if bf16 and linear and cpu_quant_bf16.takes(w):
            packed = cpu_quant_bf16.PackedQuantBf16(w)
            on_bf16 += 1
        elif takes(w):
            packed = PackedQuantWeight(w)
        else:
            return w
        packed.drop_source()
        nbytes += packed.nbytes()
        return packed

    for mod in model.modules():
        if isinstance(mod, (QuantLinear, QuantExperts)):
            linear = isinstance(mod, QuantLinear)
            mod.map_parts(lambda w: pack(w, linear))
            n += 1
    return n, nbytes, on_bf16
