"""The GPU-side tooling, exercised on CPU: gpu_check's --cpu-smoke path, and compiling every kernel for
sm_90 (codegen errors the interpreter would not see)."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _run(args, interpret):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_gpu_check_cpu_smoke():
    p = _run([str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke"], interpret=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "failed" not in p.stdout, p.stdout
    assert "copy bandwidth" in p.stdout and "lora_expand" in p.stdout


def test_gpu_check_cpu_smoke_fails_when_a_section_fails():
    """A broken section (here: the engine cannot load its model) must turn into a non-zero exit."""
    p = _run([str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke", "--model-dir", str(ROOT / "no-such-model")],
             interpret=True)
    assert p.returncode != 0 and "FAILED sections" in p.stdout, p.stdout + p.stderr


def test_gpu_check_without_cuda_exits_cleanly():
    p = _run([str(ROOT / "scripts" / "gpu_check.py")], interpret=False)
    assert p.returncode == 0 and "no CUDA device" in p.stdout, p.stdout + p.stderr


def test_kernels_compile_for_sm90():
    # bf16 only here to keep CI short; `python scripts/kernel_compile_check.py` does all dtypes
    p = _run([str(ROOT / "scripts" / "kernel_compile_check.py"), "bf16"], interpret=False)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "compiled" in p.stdout
