"""C++ CPU kernels: paged attention reading the KV cache in place, multi-LoRA over adapter rows in place, the
GEMM of linear layers over weights packed once into register-tile panels, and the pointwise work between them.

Plain C++ with a C ABI (no torch headers: it builds in seconds), compiled once per machine with the system
compiler into a per-user cache folder (never the repository) keyed by a hash of the source, flags and compiler
(concurrent first builds take turns on a lock file; the library appears by atomic rename), and called through ctypes
(which releases the GIL). Float32 activations and weights (adapter pools also bfloat16 / float16); the pointwise,
KV store and attention kernels also take bfloat16 activations and caches (float32 math). AVX2/FMA/F16C
intrinsics when the CPU has them (exp: the Cephes polynomial, about 1 ulp), and an AVX-512 GEMM tile where it has
that too; plain loops otherwise. Parallel with
OpenMP over independent work items, with torch's thread count; the library links libgomp.so.1, which resolves to
the copy torch already loaded, so both share one thread pool. `load()` returns None when there is no compiler or
the build fails: the callers then run the PyTorch references. The C++ lives in kernels/csrc/ (one file per kind
of kernel).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

import torch

log = logging.getLogger("loom")

# The C++ sources, compiled as one translation unit in this order (common.h first: includes and vector helpers).
_CSRC = Path(__file__).with_name("csrc")
_SOURCE_FILES = ("common.h", "attention.cpp", "lora.cpp", "gemm.cpp", "gemm_bf16.cpp", "pointwise.cpp", "argmax.cpp",
                 "moe.cpp", "quant_gemm.cpp", "quant_gemm_bf16.cpp", "layer.cpp")


def _expand(text: str) -> str:
    """text with each line `#include "NAME"` of a file in csrc/ replaced by that file's text (a body compiled more than
    once, under different target options: quant_gemm_bf16.cpp); other includes are left to the compiler."""
    lines = []
    for line in text.splitlines():
        name = line[len('#include "'):-1] if line.startswith('#include "') and line.endswith('"') else ""
        lines.append((_CSRC / name).read_text() if name and (_CSRC / name).is_file() else line)
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def source() -> str:
    return "\n".join(_expand((_CSRC / name).read_text()) for name in _SOURCE_FILES)


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "loom_paged_decode": [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _I64,
                          _F32, _I64, _F32, _I32],
    "loom_paged_prefill": [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _I64, _I64,
                           _F32, _I64, _F32, _I64, _I32],
    "loom_lora_apply": [_P, _I64, _P, _I32, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P,
                        _I64, _I32],
    "loom_lora_apply_bf16": [_P, _I64, _P, _I32, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P,
                             _P, _I64, _I32],
    "loom_store_kv": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64],
    "loom_rms_norm": [_P, _I64, _P, _I64, _P, _F32, _P, _I64, _P, _I64, _I64, _I64, _I32],
    "loom_rotary": [_P, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I32],
    "loom_silu_mul": [_P, _I64, _P, _I64, _I64, _I32],
    "loom_gelu_tanh_mul": [_P, _I64, _P, _I64, _I64, _I32],
    "loom_moe_experts": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I32],
    "loom_moe_experts_bf16": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I32],
    "loom_argmax": [_P, _I64, _I64, _I64, _P, _I32],
    "loom_gemm_pack": [_P, _I64, _I64, _P],
    "loom_gemm_panel_width": [],
    "loom_gemm": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _I32],
    "loom_gemm_lora": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _I32, _I64, _I64, _P, _I64, _P, _I64, _P, _P,
                       _P, _P, _P, _I64, _I64, _I64, _I32],
    "loom_decoder_layer_workspace": [_P, _I64],
    "loom_decoder_layer": [_P, _P, _P, _P, _P, _P, _P, _P],
    "loom_quant_gemm": [_P, _I64, _I64, _I64, _P, _I32, _P, _P, _F32, _P, _I64, _I64, _P, _P, _I64, _I64, _I32],
    "loom_quant_gemm_direct_rows": [],
    "loom_quant_gemm_bf16": [_P, _I64, _I64, _I64, _P, _I32, _P, _P, _F32, _P, _I64, _I64, _P, _P, _I64, _I32, _I32,
                             _I32],
    "loom_quant_gemm_bf16_panel_width": [],
    "loom_quant_gemm_bf16_built": [],
    "loom_gemm_bf16_built": [],
    "loom_gemm_bf16_panel_width": [],
    "loom_gemm_bf16_pack": [_P, _I64, _I64, _P],
    "loom_gemm_bf16": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32, _I32],
    "loom_gemm_bf16_lora": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _I32, _I64, _I64, _I64, _P, _I64, _P, _P,
                            _P, _P, _P, _P, _I64, _I64, _I32],
}
# the bfloat16 variants of the pointwise, KV store and attention kernels (ACT_SUFFIX): the same arguments, but the
# norm's, which also says whether its weight is float32
_SIGNATURES.update({f"{name}_bf16": _SIGNATURES[name] for name in (
    "loom_paged_decode", "loom_paged_prefill", "loom_store_kv", "loom_rotary", "loom_silu_mul", "loom_gelu_tanh_mul")})
_SIGNATURES["loom_rms_norm_bf16"] = [_P, _I64, _P, _I64, _P, _I32, _F32, _P, _I64, _P, _I64, _I64, _I64, _I32]


# instruction sets the kernels are built for, widest first: (name, the CPU flags it needs, compiler flags)
ISAS = (("AVX-512", ("avx512f", "avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-mavx512f")),
        ("AVX2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")))

# the others return nothing
_RESTYPES = {"loom_gemm_panel_width": _I64, "loom_decoder_layer_workspace": _I64, "loom_quant_gemm_direct_rows": _I64,
             "loom_gemm_bf16_built": _I64, "loom_gemm_bf16_panel_width": _I64,
             "loom_quant_gemm_bf16_panel_width": _I64, "loom_quant_gemm_bf16_built": _I64}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def supported_isas() -> list[tuple[str, tuple[str, ...]]]:
    """(name, compiler flags) of every instruction set in ISAS this CPU runs, widest first."""
    return [(name, flags) for name, need, flags in ISAS if cpu_flags().issuperset(need)]


@functools.lru_cache(maxsize=None)
def native_isa() -> tuple[str, ...]:
    """The widest instruction set this CPU has (AVX-512: the GEMM's register tile is twice as wide; AVX2+FMA), else
    nothing (plain loops); the build is cached per flag set. LOOM_CPU_ISA=avx2 caps it (e.g. to compare)."""
    isas = supported_isas()
    cap = os.environ.get("LOOM_CPU_ISA", "")
    if cap.strip():
        def key(name: str) -> str:  # "AVX-512", "avx512", " Avx2 " ...
            return name.strip().lower().replace("-", "")

        names = [key(name) for name, _ in isas]
        if key(cap) in names:
            isas = isas[names.index(key(cap)):]
        else:
            log.warning("LOOM_CPU_ISA=%r is none of %s (what this CPU runs): ignored", cap,
                        ", ".join(name for name, _ in isas) or "nothing")
    return isas[0][1] if isas else ()


def isa_name(isa: tuple[str, ...]) -> str:
    return next((name for name, _, flags in ISAS if flags == isa), "no AVX2")


def cache_dir() -> Path:
    """Per user and machine, never the repository: $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom or ~/.cache/loom."""
    root = os.environ.get("LOOM_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "loom")
    return Path(root) / "cpu_kernels"


def _compile(cxx: str, flags: list[str], target: Path) -> None:
    """Concurrent first builds (two server instances, two test processes) take turns on a lock file; the library
    appears under its final name only once complete (rename), so no process ever loads a partial file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if target.exists():  # another process built it while this one waited
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "kernels.cpp"
            src.write_text(source())
            out = Path(tmp) / target.name
            subprocess.run([cxx, *flags, str(src), "-o", str(out)], check=True, capture_output=True, text=True,
                           timeout=300)
            os.replace(out, target)


class NoCompiler(OSError):
    """No C++ compiler on PATH (CXX)."""


def library_path(isa: tuple[str, ...]) -> Path:
    """The library built with these instruction-set flags, compiled if it is not cached yet (on disk, keyed by
    source, flags and compiler). Compiling needs no CPU support for the flags, so every variant can be built (and
    its build tested) on any x86 host; only loading and running it needs them. Raises OSError /
    SubprocessError when there is no compiler or the compile fails."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise NoCompiler(f"no C++ compiler {cxx!r}; set CXX")
    # no FMA contraction of plain C++ expressions: the pointwise kernels round like the PyTorch references
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c++17", *isa]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([source(), version, *flags]).encode()).hexdigest()[:20]
    target = cache_dir() / f"loom_cpu_kernels_{key}.so"
    if not target.exists():
        _compile(cxx, flags, target)
    return target


@functools.lru_cache(maxsize=None)
def build(isa: tuple[str, ...]):
    """The library built with these instruction-set flags and loaded, or None after one warning when it cannot be
    built or loaded: no compiler, a failed compile, an unwritable cache."""
    try:
        lib = ctypes.CDLL(str(library_path(isa)))
    except (OSError, subprocess.SubprocessError) as e:  # a failed build: the references still work
        detail = (getattr(e, "stderr", "") or "").strip()
        reason = str(e) if isinstance(e, NoCompiler) else f"{type(e).__name__}: {e}"
        log.warning("loom CPU kernels unavailable (%s%s); using the PyTorch references", reason,
                    f"\n{detail[-2000:]}" if detail else "")
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _RESTYPES.get(name)
    return lib


def missing_flags(isa_name_: str) -> list[str]:
    """The CPU flags this host lacks to run the ISAS entry of that name (empty: it runs it)."""
    need = next(need for name, need, _ in ISAS if name == isa_name_)
    return sorted(set(need) - cpu_flags())


_lock = threading.Lock()


def enabled() -> bool:
    """LOOM_CPU_KERNELS=0 turns loom's CPU fast paths off (these kernels, pre-packed GEMMs): the references run."""
    return os.environ.get("LOOM_CPU_KERNELS", "1") != "0"


def load():
    """The library (ctypes.CDLL; functions loom_*), or None (turned off, or it cannot be built). Builds on first
    use (a few seconds, once per machine: later starts load it from cache_dir())."""
    if not enabled():
        return None
    with _lock:  # the engine thread and a test thread may race to build it
        return build(native_isa())


def built():
    """The library this machine builds, as load() returns it, whatever LOOM_CPU_KERNELS says now: for the kernels'
    wrappers, which run where kernels/policy.py found it loaded, and for weights packed while it was."""
    return build(native_isa())


def describe() -> str:
    """One line for the engine's start: which CPU path runs and why."""
    if not enabled():
        return "CPU kernels off (LOOM_CPU_KERNELS=0): the PyTorch references run"
    lib = load()
    if lib is None:
        return "CPU kernels unavailable (see the warning above): the PyTorch references run"
    return f"CPU kernels: loom C++ ({isa_name(native_isa())}) from {lib._name}"


def usable(*tensors: torch.Tensor) -> bool:
    """True when every tensor is float32 on CPU (what the C++ kernels take)."""
    for t in tensors:  # a loop, not all(<generator>): called a few hundred times a step
        if not (t.is_cpu and t.dtype == torch.float32):  # is_cpu: no device object made per call
            return False
    return True


# element types of activations and KV caches the pointwise, KV store and attention kernels take, as the suffix of
# their functions' names (bfloat16: 16-bit storage, float32 math, each result rounded once)
ACT_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}
ACT_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the same types as the C++ code's with_act reads them


def act_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The one dtype of these CPU tensors when the pointwise / attention kernels take it (ACT_SUFFIX), else None."""
    dt = tensors[0].dtype
    if dt not in ACT_SUFFIX:
        return None
    for t in tensors:
        if not (t.is_cpu and t.dtype == dt):
            return None
    return dt


# element types of adapter pools the LoRA kernels read (lora_dtype), as their type code (common.h with_type)
ADAPTER_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def adapter_type(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The type code of a pair of adapter pools the C++ LoRA kernels read (CPU, one element type of ADAPTER_TYPES,
    a [S, R, K] and b [R, N] in rows, possibly padded: a.stride(1) >= K, b.stride(0) >= N), else None."""
    if not (a.is_cpu and b.is_cpu and a.dtype == b.dtype and a.dim() == 3 and b.dim() == 2):
        return None
    _, R, K = a.shape
    rows = a.stride(2) == 1 and a.stride(1) >= K and a.stride(0) == R * a.stride(1) and b.stride(1) == 1 \
        and b.stride(0) >= b.shape[1]
    return ADAPTER_TYPES.get(a.dtype) if rows else None


def serial_thread() -> bool:
    """Make the calling thread's parallel regions (torch's CPU ops, these kernels) run on that thread alone: for a
    helper thread beside the compute thread (the adapter loader). A thread that opens a parallel region of several
    threads gets an OpenMP team of its own; with its idle workers libgomp manages more threads than there are cores
    and then cuts every team's spin-wait to ~1,000 iterations, so the compute team's workers sleep and are woken at
    every region of every later step (default model, two threads, 32 sequences decoding after one adapter load:
    504 -> 59,791 context switches in 10 s, decode step 38 -> 49 ms). False where OpenMP's runtime is not at hand."""
    torch.get_num_threads()  # torch's per-thread set-up first: it would set the thread's count to the process's
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the copy torch loaded (same soname)
    except OSError:
        return False
    gomp.omp_set_num_threads(1)
    return True


T = TypeVar("T")


def on_a_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that ends when fn returns (its result returned, its exception raised here). For work whose
    parallel regions must not leave an OpenMP team on the calling thread: a server builds its engine (load, pack,
    warm-up) on one thread and steps it on another, and the builder's team would stay beside the stepping thread's
    (see serial_thread; two threads, decode steps 34 -> 55 ms). A team ends with the thread that opened it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-build") as pool:  # its exit joins the thread
        return pool.submit(fn).result()


def contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t itself when it is already a contiguous CPU tensor of dtype (index arrays the kernels read), else a copy."""
    return t if t.dtype == dtype and t.is_cpu and t.is_contiguous() else t.to("cpu", dtype).contiguous()


def nthreads() -> int:
    return torch.get_num_threads()
