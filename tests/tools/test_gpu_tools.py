"""The GPU-side tooling, exercised on CPU: gpu_check's --cpu-smoke path (every section, its JSON lines, its exit
code when a section fails or runs out of time), and compiling every kernel for sm_90 (codegen errors the
interpreter would not see)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SECTIONS = ["kernels", "kernel_grid", "engine", "lora", "sampler", "memory", "speed", "speed_8b"]


def _run(args, interpret):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("LOOM_TEST_DEVICE", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_gpu_check_cpu_smoke(tmp_path):
    p = _run([str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke", "--out", str(tmp_path)], interpret=True)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    recs = _lines(tmp_path)
    assert sorted(r["section"] for r in recs) == sorted(SECTIONS), [r["section"] for r in recs]
    for r in recs:
        assert r["status"] == "pass" and r["device"] == "cpu" and r["smoke"], r
        statuses = [c["status"] for c in r["checks"]]
        assert "pass" in statuses, r
        # the only skip allowed here: an engine option that does not exist yet
        assert all(s == "pass" or s.startswith("skipped: not implemented") for s in statuses), r
    by = {r["section"]: r for r in recs}
    names = [c["name"] for c in by["kernels"]["checks"]]
    assert any(n.startswith("top of cache decode") for n in names) and any("lora_expand" in n for n in names)
    assert any("preemption" in c["name"] for c in by["engine"]["checks"])
    decode = by["speed"]["tables"]["decode"]["rows"]
    assert {row[2] for row in decode} >= {1, 2} and any("LoRA" in row[0] for row in decode)
    assert by["speed"]["tables"]["paged decode attention"]["rows"]
    assert {t["met"] for r in recs for t in r["targets"]} == {None}  # targets are judged on CUDA only
    assert "copy bandwidth" in p.stdout and "all sections passed" in p.stdout
    assert (tmp_path / "gpu_check_summary.txt").is_file() and (tmp_path / "gpu_check.log").is_file()


def test_gpu_check_fails_when_a_section_fails(tmp_path):
    """A broken section (here: the engine cannot load the model given) turns into a non-zero exit."""
    p = _run([str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke", "--out", str(tmp_path), "--sections", "engine",
              "--model-dir", str(ROOT / "no-such-model")], interpret=True)
    assert p.returncode == 1 and "FAILED sections: engine" in p.stdout, p.stdout + p.stderr
    (rec,) = _lines(tmp_path)
    assert rec["section"] == "engine" and rec["status"] == "fail"
    bad = [c for c in rec["checks"] if c["status"] == "fail"]
    assert len(bad) == 1 and "--model-dir" in bad[0]["name"] and "no-such-model" in bad[0]["error"], bad


def _slow_section(rec, opts):
    rec.run("finished before the limit", lambda: {"x": 1})
    time.sleep(300)


def test_gpu_check_kills_a_section_at_its_hard_limit(tmp_path):
    """A section still running at its hard limit is stopped and reported as a timeout, with the checks it had
    finished, and the JSON line is written at once."""
    import gpu_check

    args = gpu_check.parse_args(["--cpu-smoke", "--out", str(tmp_path), "--limit", "2"])
    (tmp_path / "work").mkdir()
    runner = gpu_check.Runner(args, "cpu", tmp_path, tmp_path / "work")
    (rec,) = runner.run([gpu_check.Section("slow", f"{__name__}:_slow_section", 60, 60, False)])
    assert rec["status"] == "timeout" and "hard limit of 2s" in rec["error"], rec
    assert [(c["name"], c["status"]) for c in rec["checks"]] == [("finished before the limit", "pass")]
    assert _lines(tmp_path) == [rec]


def test_gpu_check_without_cuda_exits_cleanly():
    p = _run([str(ROOT / "scripts" / "gpu_check.py")], interpret=False)
    assert p.returncode == 0 and "no CUDA device" in p.stdout, p.stdout + p.stderr


def test_kernels_compile_for_sm90():
    # bf16 only here to keep CI short; `python scripts/kernel_compile_check.py` does all dtypes
    p = _run([str(ROOT / "scripts" / "kernel_compile_check.py"), "bf16"], interpret=False)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "compiled" in p.stdout
