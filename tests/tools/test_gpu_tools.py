"""The GPU-side tooling, exercised on CPU: gpu_check's --cpu-smoke path (every section, its JSON lines, its exit
code when a section fails or runs out of time), its --plan dry run and time budget, memory's peak-step timing, and
compiling every kernel for sm_90 (codegen errors the interpreter would not see)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SECTIONS = ["kernels", "kernel_grid", "engine", "lora", "sampler", "memory", "speed", "tp", "speed_8b"]


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
    assert {tuple(row[1:4]) for row in by["tp"]["tables"]["tensor parallel decode"]["rows"]} == \
        {(tp, mode, b) for tp, mode in ((1, "eager"), (2, "graphs"), (2, "eager")) for b in (1, 2)}  # gloo
    assert any(c["name"] == "TP=2 greedy tokens: graphs = eager" for c in by["tp"]["checks"])
    assert {t["met"] for r in recs for t in r["targets"]} == {None}  # targets are judged on CUDA only
    assert "copy bandwidth" in p.stdout and "all sections passed" in p.stdout
    assert (tmp_path / "gpu_check_summary.txt").is_file() and (tmp_path / "gpu_check.log").is_file()


def test_gpu_check_tp_section_skips_on_one_gpu(tmp_path, monkeypatch):
    """The tp section on a device with one GPU: "skipped: 1 GPU", which is not a failure."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import torch

    from harness.gpu_report import Options, Recorder
    from harness.gpu_tp import run_tp

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rec = Recorder("tp", Options(smoke=False, device="cuda", work_dir=str(tmp_path), log_path="", model_dir="",
                                 deadline=time.time() + 60, optional=True), None)
    run_tp(rec, rec.opts)
    out = rec.finish()
    assert out["status"] == "skipped: 1 GPU" and out["checks"] == [], out
    assert not gpu_check.section_failed(out)
    assert gpu_check.section_failed({"status": "skipped: 2 ranks"}) and gpu_check.section_failed({"status": "fail"})


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


def test_gpu_check_optional_section_out_of_time_is_not_a_failure(tmp_path):
    """The same hard limit on the optional section (the 8B sweep): reported as "skipped: time" with what it had
    finished, and not a failure; a correctness section's timeout (above) is one."""
    import gpu_check

    args = gpu_check.parse_args(["--cpu-smoke", "--out", str(tmp_path), "--limit", "2"])
    (tmp_path / "work").mkdir()
    runner = gpu_check.Runner(args, "cpu", tmp_path, tmp_path / "work")
    required, optional = runner.run([gpu_check.Section("slow", f"{__name__}:_slow_section", 60, 60, True),
                                     gpu_check.Section("extra", f"{__name__}:_slow_section", 60, 60, True, True)])
    assert required["status"] == "timeout" and gpu_check.section_failed(required), required
    assert optional["status"] == "skipped: time" and not gpu_check.section_failed(optional), optional
    assert [c["status"] for c in optional["checks"]] == ["pass"]


def test_gpu_check_limits_fit_its_budget():
    """By construction: every section can run to its limit and the run still ends inside its budget; the 1B speed
    numbers come before the optional sections (TP on 2+ GPUs, then the 8B sweep), the only optional ones."""
    import gpu_check

    total = sum(s.limit_s for s in gpu_check.SECTIONS)
    assert total <= gpu_check.BUDGET_S - gpu_check.MARGIN_S, total
    assert gpu_check.limits_fit(gpu_check.SECTIONS, gpu_check.BUDGET_S, gpu_check.MARGIN_S)
    assert not gpu_check.limits_fit(gpu_check.SECTIONS, total + gpu_check.MARGIN_S - 1, gpu_check.MARGIN_S)
    assert gpu_check.BUDGET_S <= 480  # a run and a rerun of its failed sections in 15 minutes of device time
    names = [s.name for s in gpu_check.SECTIONS]
    assert names.index("memory") < names.index("speed") < names.index("speed_8b") == len(names) - 1
    assert [s.name for s in gpu_check.SECTIONS if s.optional] == ["tp", "speed_8b"]


def test_gpu_check_plan_rows():
    """Side-by-side sections start together and each compiles all of its variants; a section run alone counts only
    what no earlier lone section launched (the shared Triton cache has the rest)."""
    import gpu_check

    secs = [gpu_check.Section("a", "m:f", 30, 30, False), gpu_check.Section("b", "m:f", 30, 30, False),
            gpu_check.Section("c", "m:f", 20, 20, True), gpu_check.Section("d", "m:f", 20, 20, True)]
    rows = gpu_check.plan_rows(secs, {"a": ["k1", "k2"], "b": ["k1"], "c": ["k1", "k3"], "d": ["k1", "k3", "k4"]})
    assert [(r["variants"], r["new"]) for r in rows] == [(2, 2), (1, 1), (2, 2), (3, 1)]
    rows = gpu_check.plan_rows(secs[:1], {"a": [f"k{i}" for i in range(40)]})
    assert rows[0]["compile_s"] == 40 * gpu_check.COMPILE_S and not rows[0]["fits"]  # past its soft deadline
    assert gpu_check.plan_rows(secs[:1], {})[0]["fits"] is False  # no record: not shown as fitting


def test_gpu_check_plan(tmp_path):
    """The dry run: each section's code path on CPU with its Triton launches recorded for sm_90; every section
    that launches Triton kernels on the GPU records variants here, and the plan fits the budget."""
    p = _run([str(ROOT / "scripts" / "gpu_check.py"), "--plan", "--out", str(tmp_path)], interpret=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    plan = json.loads((tmp_path / "gpu_check_plan.json").read_text())
    rows = {r["section"]: r for r in plan["rows"]}
    assert list(rows) == SECTIONS
    assert all(rows[s]["variants"] > 0 for s in SECTIONS if s != "sampler"), rows  # the sampler has no kernel
    assert all(r["fits"] for r in rows.values()), rows
    assert plan["limits_sum_s"] <= plan["budget_s"]
    for name in SECTIONS:
        assert any(line.startswith(name + " ") for line in p.stdout.splitlines()), p.stdout
    assert "margin" in p.stdout


def test_peak_prefill_step_times_the_prefill(tmp_path):
    """memory's largest-prefill measurement times the step that runs the whole prompt (not a decode after it):
    the timed step's tokens are checked, and a prefill run before the timed step is caught."""
    from harness import gpu_perf
    from harness.random_llama import TINY_A, ensure_random_llama, remove_scratch

    model = ensure_random_llama(tmp_path, "tiny", dict(TINY_A, max_position_embeddings=4096), "cpu")
    try:
        _check_peak_steps(gpu_perf, model)
    finally:  # the model may sit in /dev/shm, outside tmp_path
        remove_scratch(tmp_path)


def _check_peak_steps(gpu_perf, model: str) -> None:
    import pytest

    state = {}
    gpu_perf._default_start(model, "cpu", state, {"max_num_seqs": 4})
    eng = state["eng"]
    n = eng.config.max_num_batched_tokens
    assert n < eng.max_model_len
    assert gpu_perf._peak_step(state, "prefill")["step_tokens"] == n
    assert gpu_perf._peak_step(state, "decode")["step_tokens"] == 4
    add = eng.add_request

    def add_then_step(*a, **k):  # the prefill runs before the timed step: what is timed is a one-row decode
        add(*a, **k)
        eng.step()

    eng.add_request = add_then_step
    with pytest.raises(AssertionError, match=f"not the {n}-token prefill: 1 decode rows"):
        gpu_perf._peak_step(state, "prefill")


def test_gpu_check_without_cuda_exits_cleanly():
    p = _run([str(ROOT / "scripts" / "gpu_check.py")], interpret=False)
    assert p.returncode == 0 and "no CUDA device" in p.stdout, p.stdout + p.stderr


def test_kernels_compile_for_sm80_and_sm90():
    # bf16 only here to keep CI short; `python scripts/kernel_compile_check.py` does all dtypes
    p = _run([str(ROOT / "scripts" / "kernel_compile_check.py"), "bf16"], interpret=False)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "compiled" in p.stdout
    # every split decode variant (serving head dims 64/128/256 and the edge case 8, with and without rope_store, for
    # sm_80 and sm_90: 16; an fp8 cache's variants besides) passed ticket_order
    m = re.search(r"ticket order in the PTX of (\d+) split decode variants", p.stdout)
    assert m and int(m.group(1)) >= 16, p.stdout


TICKET_PTX = """
    @%p1 st.global.b32 [ %rd1 + 0 ], { %r1 };  // a partial
    bar.sync 0;
    @%p2 atom.global.gpu.acq_rel.add.u32 %r2, [ %rd2 + 0 ], %r3;
    @%p2 st.shared.b32 [ %r4 + 0 ], %r2;
    bar.sync 0;
    @%p3 ld.global.cg.b32 { %r5 }, [ %rd1 + 0 ];
"""


def test_ticket_order_sees_a_missing_barrier_or_weak_atomic():
    """kernel_compile_check.ticket_order on a hand-made PTX excerpt and on it with each guarantee removed."""
    lines = TICKET_PTX.splitlines()
    variants = [TICKET_PTX, "\n".join(lines[:2] + lines[3:]), "\n".join(lines[:5] + lines[6:]),
                TICKET_PTX.replace("acq_rel", "relaxed"), TICKET_PTX + TICKET_PTX]
    code = ("import json, sys, kernel_compile_check as kcc\n"
            "print(json.dumps([kcc.ticket_order(p) for p in json.loads(sys.stdin.read())]))")
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(variants), cwd=ROOT / "scripts",
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert p.returncode == 0, p.stderr[-4000:]
    ok, no_release, no_acquire, relaxed, two = json.loads(p.stdout.splitlines()[-1])
    assert ok is None, ok
    assert "between the partial stores and the ticket" in no_release, no_release
    assert "between the ticket and the merge's loads" in no_acquire, no_acquire
    assert "want one" in relaxed and "want one" in two, (relaxed, two)
