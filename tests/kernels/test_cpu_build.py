"""The C++ CPU kernels' build (kernels/cpu_ext.py): without a compiler or with a failing one, the dispatcher
runs the PyTorch references (identical results, one warning); concurrent first builds compile once."""
import os
import time

import pytest
import torch

import harness.kernel_cases as kcases
from loom.kernels import cpu_ext, dispatch, lora
from loom.kernels.paged_decode_attention import paged_decode_attention_ref


def _fake_compiler(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no library loaded yet in this process; the real one is reloaded afterwards."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LOOM_FORCE_TRITON", raising=False)
    cpu_ext.build.cache_clear()
    yield tmp_path
    cpu_ext.build.cache_clear()


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_failed_build_runs_the_references(compiler, fresh_build, monkeypatch, caplog):
    from loom.kernels.activation import silu_and_mul_ref
    from loom.kernels.norm import fused_add_rms_norm_ref

    cxx = str(fresh_build / "no-such-g++") if compiler == "missing" else \
        _fake_compiler(fresh_build / "g++", 'echo "fatal error: broken toolchain" >&2; exit 1\n')
    monkeypatch.setenv("CXX", cxx)
    with caplog.at_level("WARNING", logger="loom"):
        assert cpu_ext.load() is None and cpu_ext.load() is None
    lines = [r.getMessage() for r in caplog.records if r.name == "loom"]
    assert len(lines) == 1 and "unavailable" in lines[0] and "PyTorch references" in lines[0]  # once, not per call
    assert "broken toolchain" in lines[0] if compiler == "failing" else "no C++ compiler" in lines[0]
    assert "unavailable" in cpu_ext.describe()
    torch.manual_seed(2)
    kc, vc, bt, sl = kcases.make_paged_cache([37, 90, 5], 16, 3, 64, torch.float32, "cpu")
    q = torch.randn(3, 9, 64)
    assert torch.equal(dispatch.paged_decode_attention(q, kc, vc, bt, sl, 0.125, sliding_window=20, softcap=3.0),
                       paged_decode_attention_ref(q, kc, vc, bt, sl, 0.125, sliding_window=20, softcap=3.0))
    x, w = torch.randn(4, 64), torch.rand(64)
    assert all(torch.equal(a, b) for a, b in zip(dispatch.fused_add_rms_norm(x, x, w, 1e-6),
                                                   fused_add_rms_norm_ref(x, x, w, 1e-6)))
    assert torch.equal(dispatch.silu_and_mul(x), silu_and_mul_ref(x))
    meta, R, _ = kcases.make_lora_meta(6, [1, 4], "cpu")
    a, b, y = torch.randn(1, R, 64), torch.randn(R, 8), torch.randn(6, 8)
    xs = x.repeat(2, 1)[:6]
    assert torch.equal(dispatch.lora_apply(xs, y.clone(), a, b, [0, 8], meta),
                       lora.lora_expand_ref(lora.lora_shrink_ref(xs, a, meta), b, [0, 8], meta, y.clone()))
    from loom.kernels import policy

    assert not policy.decide("cpu", torch.float32).packed  # linear layers stay F.linear


def test_concurrent_first_builds_compile_once(fresh_build):
    """Two builders of the same library (two server instances starting together): the second waits for the
    first's lock, then finds the finished library and compiles nothing; nothing half-written is ever visible."""
    import threading

    log = fresh_build / "calls"
    # a compiler that takes a moment and writes its output in two parts (a reader of a partial file would see it)
    cxx = _fake_compiler(fresh_build / "g++", f'echo run >> {log}\nout=""\nwhile [ $# -gt 0 ]; do '
                         'if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\n'
                         'printf part > "$out"; sleep 0.3; printf done >> "$out"\n')
    target = cpu_ext.cache_dir() / "lib.so"
    errors = []

    def build():
        try:
            cpu_ext._compile(cxx, ["-O3"], target)
            assert target.read_text() == "partdone"
        except Exception as e:  # reported below: an assertion in a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert log.read_text().split() == ["run"]
    assert sorted(p.name for p in target.parent.iterdir()) == [".lib.so.lock", "lib.so"]  # no temporary left


@pytest.mark.parametrize("isa", [name for name, _, _ in cpu_ext.ISAS] + ["no-avx2"])
def test_every_variant_compiles_on_any_host(isa):
    """Every build (AVX-512, AVX2, plain loops) compiles here whatever this CPU runs: a machine with other
    instructions is never the first place a variant is compiled. The library exports every function the loader
    binds (read from the file: a variant this CPU cannot run is not loaded)."""
    flags = next((f for name, _, f in cpu_ext.ISAS if name == isa), ())
    lib = cpu_ext.library_path(flags).read_bytes()
    assert [name for name in cpu_ext._SIGNATURES if name.encode() + b"\0" not in lib] == []


@pytest.mark.parametrize("threads", [1, 2])
def test_every_instruction_set_gives_the_same_gemm_bits(threads, monkeypatch):
    """The GEMM's register tile is 4 x 24 with AVX2 and 8 x 48 with AVX-512 (its panels packed to match), but every
    output element is one fma chain over k in order: each build this CPU runs gives the same bits (and the references'
    result), for row counts and widths that are no multiple of either tile, with a bias, and with LoRA deltas (added
    to the GEMM's output tiles, and in a pass of their own, of prefill chunks and decode tokens, from float32 and
    bfloat16 pools; the shrink's lanes are the same at either width)."""
    from loom.kernels import cpu_lora
    from loom.kernels.cpu_linear import PackedWeight, panel_width

    isas = cpu_ext.supported_isas()
    monkeypatch.setattr(cpu_ext, "nthreads", lambda: threads)
    torch.manual_seed(6)
    K, offs = 70, [0, 48, 61, 61 + 130]
    w, bias = torch.randn(offs[-1], K), torch.randn(offs[-1])
    # groups of 19, 9 and 14 tokens: every remainder of the shrink's 3 or 4 rows (AVX2 / AVX-512) and of the tiles
    meta, R, _ = kcases.contiguous_lora_meta([(0, 19), (-1, 3), (1, 9), (2, 14)], [16, 5, 8])
    # decode: a token per group (tiles of one token, their own register blocks)
    decode, _, _ = kcases.contiguous_lora_meta([(1, 1), (0, 1), (2, 1), (-1, 2)], [16, 5, 8])
    a, b = torch.randn(3, R, K), torch.randn(R, offs[-1])
    xs = [torch.randn(m, K) for m in (1, 5, 8, 13, 45, 64)]
    results, widths = [], []
    for _, flags in isas:
        monkeypatch.setattr(cpu_ext, "native_isa", lambda flags=flags: flags)
        pw = PackedWeight(w, bias)
        widths.append(panel_width())
        res = [pw(x) for x in xs]
        for fuse_min in (1, 1 << 30):  # every group's deltas in the GEMM's tiles; every group in its own pass after
            monkeypatch.setattr(cpu_lora, "FUSE_MIN_TOKENS", fuse_min)
            res.append(pw.with_lora(xs[4], a, b, offs, meta))
            res.append(pw.with_lora(xs[4], a.bfloat16(), b.bfloat16(), offs, meta))  # 16-bit pools (lora_dtype)
        res.append(pw.with_lora(xs[1], a, b, offs, decode))
        results.append(res)
    assert widths == [{"AVX-512": 48, "AVX2": 24}[name] for name, _ in isas]
    for got in results[1:]:
        assert all(torch.equal(g, r) for g, r in zip(got, results[0]))
    for x, y in zip(xs, results[0]):
        assert kcases.rel_err(y, torch.nn.functional.linear(x, w, bias)) < 1e-5
    ref = lora.lora_expand_ref(lora.lora_shrink_ref(xs[4], a, meta), b, offs, meta,
                               torch.nn.functional.linear(xs[4], w, bias))
    lora_out = results[0][len(xs):-1]  # per fuse_min: float32 pools, bfloat16 pools
    assert all(kcases.rel_err(y, ref) < 1e-5 for y in lora_out[0::2])
    ref16 = lora.lora_expand_ref(lora.lora_shrink_ref(xs[4], a.bfloat16(), meta), b.bfloat16(), offs, meta,
                                 torch.nn.functional.linear(xs[4], w, bias))
    assert all(torch.equal(y, lora_out[1]) for y in lora_out[1::2]) and kcases.rel_err(lora_out[1], ref16) < 1e-5
    ref_dec = lora.lora_expand_ref(lora.lora_shrink_ref(xs[1], a, decode), b, offs, decode,
                                   torch.nn.functional.linear(xs[1], w, bias))
    assert kcases.rel_err(results[0][-1], ref_dec) < 1e-5


def test_loom_cpu_isa_caps_the_build(monkeypatch, caplog):
    """LOOM_CPU_ISA=avx2 builds for AVX2 on a CPU with AVX-512 (what a comparison needs); a name this CPU does not
    run is ignored with one warning that says what it runs."""
    isas = cpu_ext.supported_isas()
    try:
        for value, want in (("avx2", dict(isas).get("AVX2")), ("AVX2", dict(isas).get("AVX2")), ("", isas[0][1])):
            monkeypatch.setenv("LOOM_CPU_ISA", value)
            cpu_ext.native_isa.cache_clear()
            assert cpu_ext.native_isa() == want
        monkeypatch.setenv("LOOM_CPU_ISA", "sse9")
        cpu_ext.native_isa.cache_clear()
        with caplog.at_level("WARNING", logger="loom"):
            assert cpu_ext.native_isa() == isas[0][1]
        assert [r.getMessage() for r in caplog.records] == [
            f"LOOM_CPU_ISA='sse9' is none of {', '.join(n for n, _ in isas)} (what this CPU runs): ignored"]
    finally:
        monkeypatch.delenv("LOOM_CPU_ISA")
        cpu_ext.native_isa.cache_clear()


def _tasks_settle(want: int, timeout_s: float = 5.0) -> int:
    """The process's thread count once it reaches `want` (or the timeout): ended threads leave /proc a moment later."""
    deadline = time.monotonic() + timeout_s
    while (n := len(os.listdir("/proc/self/task"))) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def test_a_passing_thread_leaves_no_openmp_team():
    """Work with parallel regions run by on_a_passing_thread leaves no OpenMP workers behind (a server's engine is
    built there and stepped on its loop thread, whose team must be the only one); its result and its exception
    come back to the caller."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = len(os.listdir("/proc/self/task"))
        assert cpu_ext.on_a_passing_thread(lambda: float((torch.ones(1 << 22) * 2).sum())) == 2.0 * (1 << 22)
        assert _tasks_settle(before) == before
        with pytest.raises(ValueError, match="from the thread"):
            cpu_ext.on_a_passing_thread(lambda: int("from the thread"))
    finally:
        torch.set_num_threads(prev)
