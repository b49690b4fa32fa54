"""The benchmark scripts (scripts/bench_*.py) at tiny sizes: they run, print their tables, and write JSON + PNG.
Not timed tests: the numbers are not checked, only that every system ran and produced the right tokens.
bench_serving against a real tritonserver: tests/e2e/test_bench_serving.py (on the e2e tests' server)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import harness.bench as bc

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def run_script(script: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run scripts/<script> with this interpreter; it must exit 0."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    # one intra-op thread: with two, any other load on a 2-core box makes torch crawl (measured, bench_offline at
    # this size on a loaded box: 97 s with 2 threads, 18 s with 1); the numbers are not checked here
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} failed:\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return p


def one_file(out: Path, pattern: str) -> Path:
    found = sorted(out.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {out}, found {found}"
    return found[0]


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


# ---- harness.bench --------------------------------------------------------------------------------

def test_prompts_are_ordinary_and_varied():
    assert len(bc.PROMPTS) >= 60 and len(set(bc.PROMPTS)) == len(bc.PROMPTS)
    assert all(p[0].isupper() and p.rstrip()[-1] in ".?!" for p in bc.PROMPTS)
    assert bc.prompts(3) == bc.PROMPTS[:3]
    assert bc.prompts(len(bc.PROMPTS) + 2)[-2:] == bc.PROMPTS[:2]


def test_statistics():
    assert bc.percentile([1, 2, 3, 4], 50) == 2.5
    assert bc.percentile([5], 99) == 5
    assert bc.percentile(list(range(101)), 99) == pytest.approx(99)
    s = bc.summarize([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["p50"] == 2.0 and s["max"] == 3.0
    assert bc.summarize([])["n"] == 0
    assert bc.ratio(2.0, 4.0) == 0.5
    assert bc.ratio(1.0, 0.0) != bc.ratio(1.0, 0.0)  # nan
    t = bc.table(["a", "b"], [["x", 1.2345], ["yy", None]])
    assert "1.23" in t and "-" in t.splitlines()[-1]


# ---- bench_offline -------------------------------------------------------------------------------

def test_bench_offline_smoke(tmp_path):
    p = run_script("bench_offline.py", "--num-prompts", "4", "--max-tokens", "8", "--hf-batch-size", "2",
                   "--no-warmup", "--out-dir", str(tmp_path), "--progress-every", "5")
    assert "loom" in p.stdout and "hf-static" in p.stdout and "x loom" in p.stdout
    assert "KV memory holding real tokens at peak" in p.stdout
    assert "loom eager 1t: running" in p.stderr  # progress lines (one loom run per thread count and forward)
    data = json.loads(one_file(tmp_path, "bench_offline-*.json").read_text())
    loom = data["systems"]["loom eager 1t"]
    assert [len(t) for t in loom["tokens"]] == [8] * 4  # EOS ignored: exactly max_tokens each
    assert loom["tokens_per_s"] > 0 and len(loom["latencies_s"]) == 4
    assert 0 < loom["kv"]["share_at_peak"] <= 1 and loom["num_preemptions"] == 0
    static = data["systems"]["hf-static"]
    assert "error" not in static, static
    assert [len(t) for t in static["tokens"]] == [8] * 4
    ag = loom["agreement_vs_hf_static"]
    # 8 greedy tokens in float32: padding may change a token now and then, not most of them
    assert ag["total"] == 4 and ag["identical"] >= 3, ag
    cb = data["systems"]["hf-cb"]  # transformers' continuous batching: a failure is reported, not fatal
    if "error" not in cb:
        assert [len(t) for t in cb["tokens"]] == [8] * 4
        assert "hf-cb" in p.stdout
    else:
        assert "hf-cb" in p.stdout and "FAILED" in p.stdout
    if has_matplotlib():
        assert one_file(tmp_path, "bench_offline-*.png").stat().st_size > 0


# ---- bench_overhead ------------------------------------------------------------------------------

def test_bench_overhead_smoke(tmp_path):
    p = run_script("bench_overhead.py", "--seqs", "4", "16", "--steps", "3", "--warmup-steps", "1",
                   "--prompt-len", "20", "--vocab", "512", "--out-dir", str(tmp_path))
    assert "running seqs" in p.stdout and "schedule" in p.stdout
    data = json.loads(one_file(tmp_path, "bench_overhead-*.json").read_text())
    # one row per size and host path (persistent sampling state, and the rebuild-every-step reference)
    assert [(r["num_seqs"], r["path"]) for r in data["results"]] == \
        [(4, "persistent"), (4, "simple"), (16, "persistent"), (16, "simple")]
    for r in data["results"]:
        assert r["step_us"] > 0 and r["prepare_us"] > 0 and r["schedule_us"] > 0
        assert r["block_table_width"] >= 2  # 20 prompt tokens + decode in blocks of 16
    if has_matplotlib():
        assert one_file(tmp_path, "bench_overhead-*.png").stat().st_size > 0


# ---- bench_lora -------------------------------------------------------------------------------------

def test_bench_lora_smoke_leaves_no_adapters_behind(tmp_path, monkeypatch):
    """bench_lora at a tiny size with two thread counts: every scenario's tokens/s, the targets, the JSON; and the
    adapters it wrote into a temporary folder (~600 MB at the default size) are gone when it ends."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    out = tmp_path / "lora.json"
    p = run_script("bench_lora.py", "--requests", "2", "--prompt-len", "4", "--max-tokens", "2", "--repeats", "1",
                   "--no-hot-load", "--lora-memory-mb", "64", "--threads", "1", "2", "--json", str(out))
    for t in (1, 2):  # one engine per thread count, each with its own row and targets
        assert f"TARGET loom ({t}t): one adapter" in p.stdout, p.stdout
    looms = json.loads(out.read_text())["loom"]
    from loom.engine.worker.cpu import available_cores

    assert [looms[t]["torch_threads"] for t in ("1", "2")] == [1, min(2, available_cores())]
    assert all(loom["stream_gb_s"] > 0 for loom in looms.values())
    assert "would cap the distinct ratio at" in p.stdout, p.stdout
    assert "where the time goes" in p.stdout, p.stdout
    for loom in looms.values():
        for name in ("no_lora", "one_adapter", "distinct_adapters"):
            assert loom[name]["tokens_per_s"] > 0, name
            assert all(len(tokens) == 2 for tokens in loom[name]["tokens"]), name
            # 2 prompts x 2 tokens: the prompts' step(s), then one decode step
            assert loom[name]["steps"]["prefill_steps"] >= 1 and loom[name]["steps"]["decode_steps"] == 1, name
    assert not list(tmp.glob("loom-bench-adapters-*"))


def test_bench_lora_many_adapters_smoke(tmp_path):
    """--adapters: Poisson traffic over many adapters (few device rows) against one adapter: every run's row, the
    deciles, first use by tier, the targets; every request within the scheduler's stated bound."""
    out = tmp_path / "traffic.json"
    p = run_script("bench_lora.py", "--adapters", "12", "--popularity", "zipf:1.0", "uniform", "--arrivals", "8",
                   "--max-tokens", "3", "--prompt-len", "4", "--device-adapters", "2", "--host-adapters", "4",
                   "--weight-files", "2", "--shift-at", "0.5", "--json", str(out))
    assert "popularity shift at request 4 " in p.stdout, p.stdout  # its windows may not fit so short a run: said
    for pop in ("zipf:1.0", "uniform"):
        assert f"TARGET {pop}: tokens/s >= 0.80x one adapter" in p.stdout, p.stdout
        assert f"TARGET {pop}: every request's queue time within the stated bound: " in p.stdout
        assert [ln for ln in p.stdout.splitlines() if ln.startswith(f"TARGET {pop}: every request")][0].endswith(" met")
    for pop in ("one adapter", "zipf:1.0", "uniform"):  # what each run's steps read and its loader's CPU
        assert re.search(rf"^{pop}: its steps read [0-9.]+ GB of rank rows \([0-9.]+ s at the [0-9.]+ GB/s read "
                         rf"here: [0-9]+% of its [0-9.]+ s\); the loader process [0-9.]+ s of CPU$", p.stdout, re.M), \
            p.stdout
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert set(runs) == {"one adapter", "zipf:1.0", "uniform"}
    assert all(r["tokens"] == 8 * 3 for r in runs.values())
    # one adapter: every step that ran a request read that adapter's rows once; more adapters, more distinct rows
    assert all(d == (b > 0) for _, b, _, _, d in runs["one adapter"]["steps"])
    assert all(d <= b for _, b, _, _, d in runs["zipf:1.0"]["steps"])
    assert res["adapter_bytes"] > 0 and res["stream_gb_s"] > 0


def test_bench_lora_many_adapters_warm_start(tmp_path):
    """--warm N: each popularity run starts after N one-token requests from its popularity, so its requests find
    adapters in the host tier or device rows that a cold start reads from disk."""
    out = tmp_path / "warm.json"
    p = run_script("bench_lora.py", "--adapters", "12", "--popularity", "zipf:1.0", "--arrivals", "8",
                   "--max-tokens", "2", "--prompt-len", "4", "--device-adapters", "2", "--host-adapters", "12",
                   "--weight-files", "2", "--warm", "16", "--json", str(out))
    assert "each popularity run after 16 one-token requests from its popularity" in p.stdout, p.stdout
    run = json.loads(out.read_text())["runs"]["zipf:1.0"]
    assert run["tokens"] == 8 * 2
    tiers = run["requests"]["tier"]
    assert any(t in ("host", "device") for t in tiers), tiers
    # the warm-up's loads are not the run's: the run reads from disk only adapters its warm-up did not use
    assert sum(t == "disk_to_host" for t, _ in run["loads"]) <= sum(t == "disk" for t in tiers)


def test_vllm_traffic_runs_get_loom_s_warm_up(monkeypatch):
    """--warm with --vllm-python: vLLM runs each popularity run's warm-up requests (untimed) before the run, its
    adapters among those the job registers; a run without one (one adapter) gets none."""
    import argparse

    import bench_lora

    jobs = []
    monkeypatch.setattr(bench_lora, "run_vllm_settings", lambda args, job, progress, tag: jobs.append(job) or {})
    args = argparse.Namespace(max_tokens=3, rank=16, device_adapters=2, host_adapters=4)
    names = [f"ad{i}" for i in range(6)]
    runs = {"one adapter": {"ranks": [0, 0]},
            "zipf:1.0": {"ranks": [0, 1], "warm": {"ranks": [5, 4, 0], "prompts": [[1], [2], [3]]}}}
    bench_lora.run_vllm_traffic(args, "m", "/root", "float32", names, [[7], [8]], [0.0, 0.1], runs)
    (job,) = jobs
    by_name = {r["name"]: r for r in job["runs"]}
    assert "warm" not in by_name["one adapter"]
    assert by_name["zipf:1.0"]["warm"] == {"prompts": [[1], [2], [3]], "loras": ["ad5", "ad4", "ad0"],
                                          "max_tokens": 1}
    assert set(job["adapters"]) == {"ad0", "ad1", "ad4", "ad5"}


def test_a_runs_loads_are_those_numbered_after_the_last_one_before_it():
    """The registry keeps its most recent loads only: once it holds RECENT_LOADS, a count taken before a run no longer
    indexes the run's loads; their numbers do."""
    from harness.lora import last_load_seq
    from loom.lora.lora_stats import RECENT_LOADS, LoadLog

    log = LoadLog()
    for _ in range(RECENT_LOADS + 50):
        log.record("disk_to_host", 0.01)
    seq0 = last_load_seq(log.recent())
    for _ in range(7):
        log.record("host_to_device", 0.001)
    assert len(log.recent()) == RECENT_LOADS  # the count did not move
    assert [x.tier for x in log.recent() if x.seq > seq0] == ["host_to_device"] * 7
    assert last_load_seq(()) == 0


def test_popularity_shift_and_recovery_time():
    """--shift-at: the second part's hot set is adapters the first part did not favour; recovery = the seconds from
    the shift until every later whole window is back at >= 0.9x the median rate before it."""
    from harness.lora import recovery_s, shift_ranks

    assert shift_ranks([0, 1, 0, 2, 0, 9], 10, 0.5) == [0, 1, 0, 7, 5, 4]
    assert shift_ranks([0, 1], 10, 0.0) == [0, 1]
    steady = [(t / 10, 1) for t in range(100)]  # 10 tok/s for 10 s
    assert recovery_s(steady, 4.0, 10.0, 1.0) == (10.0, 10.0, 0.0)  # never dropped
    dip = [(t, k) for t, k in steady if not 4.0 <= t < 6.0]  # nothing made for 2 s after the shift
    assert recovery_s(dip, 4.0, 10.0, 1.0) == (10.0, 0.0, pytest.approx(2.0))
    late = [(t, k) for t, k in steady if t < 9.0]  # the last whole window (9..10) is still low
    assert recovery_s(late, 4.0, 10.0, 1.0)[2] is None
    with pytest.raises(ValueError, match="no whole window"):
        recovery_s(steady, 0.5, 10.0, 1.0)


def test_step_times_are_compared_with_steps_of_about_the_same_batch():
    """matched_ratios: a step's time over the median of the reference steps whose batch is within 20% of its own (a
    reference step's own time left out of its reference), steps with fewer than 3 such left out - a step of 60
    requests is not set against steps of 12."""
    import statistics

    from harness.lora_report import MATCH_MIN, MATCH_TOL, matched_ratios

    ref = [(10.0 + b, b) for b in (10, 11, 12, 12, 13, 50, 52, 55, 60)]
    busy = [(80.0, 55), (30.0, 12), (99.0, 30)]  # batch 30: no reference step near it

    def direct(steps, own):
        out = []
        for i, (ms, b) in enumerate(steps):
            near = [m for j, (m, rb) in enumerate(ref) if b / (1 + MATCH_TOL) <= rb <= b * (1 + MATCH_TOL)
                    and not (own and j == i)]
            if len(near) >= MATCH_MIN:
                out.append(ms / statistics.median(near))
        return out

    assert matched_ratios(ref, busy) == pytest.approx(direct(busy, False))
    assert matched_ratios(ref, busy) == pytest.approx([80.0 / 63.5, 30.0 / 22.0])  # batches 50-60; 10-13
    assert matched_ratios(ref, ref) == pytest.approx(direct(ref, True))
    assert len(matched_ratios(ref, ref)) == len(ref)
    assert matched_ratios(ref[:2], busy) == []


def test_traffic_report_sets_vllm_beside_loom_run_by_run():
    """vLLM on the same traffic: its ratio to its own one-adapter run, TTFT by the popularity decile of each request's
    adapter (from loom's ranks), a failed setting reported, and loom's tokens/s against vLLM's best setting."""
    from harness.lora_report import vllm_traffic_lines

    def vrun(tps, ttfts):
        return {"tokens_per_s": tps, "requests": [{"ttft_s": t} for t in ttfts]}

    runs = {"one adapter": {"tokens": 40, "wall_s": 1.0, "ranks": [0] * 4},  # loom: 40 and 30 tok/s
            "zipf:1.0": {"tokens": 30, "wall_s": 1.0, "ranks": [0, 0, 5, 9]}}
    vllm = {"vllm auto": {"vllm_version": "0.32.0", "runs": {"one adapter": vrun(20.0, [0.1] * 4),
                                                             "zipf:1.0": vrun(10.0, [0.1, 0.2, 0.5, 0.9])}},
            "vllm 0,1": {"vllm_version": "0.32.0", "runs": {"one adapter": vrun(25.0, [0.1] * 4),
                                                            "zipf:1.0": vrun(35.0, [0.1] * 4)}},
            "vllm 0": {"error": "boom\nmore"}}
    checks: list = []
    text = "\n".join(vllm_traffic_lines(vllm, runs, 10, checks))
    assert "vllm 0: FAILED (boom)" in text
    rows = {tuple(ln.split()[:4]): ln.split()[4:] for ln in text.splitlines() if ln.startswith("vllm auto")}
    assert rows[("vllm", "auto", "zipf:1.0", "10.00")][0] == "0.50"  # 10 / 20 tok/s: its own one-adapter ratio
    # deciles of 10 adapters (from loom's ranks): ad0 twice in decile 1, ad5 alone in decile 6, ad9 in decile 10
    assert rows[("vllm", "auto", "zipf:1.0", "1")] == ["2", "199.00"]
    assert rows[("vllm", "auto", "zipf:1.0", "6")] == ["1", "500.00"]
    assert rows[("vllm", "auto", "zipf:1.0", "10")] == ["1", "900.00"]
    verdict = {what: ok for what, ok, _ in checks}
    assert verdict == {"one adapter: loom tokens/s above vLLM's (vllm 0,1)": True,  # 40 > 25
                       "zipf:1.0: loom tokens/s above vLLM's (vllm 0,1)": False}  # 30 < 35
    assert vllm_traffic_lines({}, runs, 10, []) == []
    assert "warm-up" not in text
    runs["zipf:1.0"]["warm"] = {"ranks": [1], "prompts": [[1]]}  # --warm: the header says vLLM ran it too
    assert "each run after the same warm-up requests" in "\n".join(vllm_traffic_lines(vllm, runs, 10, []))


def test_bench_lora_report_pairs_each_loom_with_vllm_at_equal_compute():
    """Each loom thread count is set against the vLLM setting computing on as many threads; the no-LoRA target takes
    loom's best against vLLM's best; token agreement covers every loom row."""
    import argparse

    import harness.lora_report as bl

    def res(none, one, dis, tokens=((1, 2), (3, 4))):
        cpu = {"other_cpu_s": 0.0}
        out = {sc: {"tokens_per_s": v, "tokens": [list(t) for t in tokens], "cpu": cpu}
               for sc, v in zip(bl.SCENARIOS, (none, one, dis))}
        return out | {"startup_s": 1.0}

    v1, v2 = res(60.0, 18.0, 18.0), res(100.0, 30.0, 33.0)  # vLLM "0" computes on 1 thread, "0,1" on 2
    vllm = {sc: v2[sc] | {"setting": "0,1", "startup_s": 90.0, "vllm_version": "0.32.0"} for sc in bl.SCENARIOS}
    vllm |= {"_per_setting": {"0": v1, "0,1": v2}, "_all": {"vllm plain 0": {"startup_s": 90.0}}}
    looms = {"1": res(70.0, 68.0, 50.0) | {"rounds": [], "stream_gb_s": 10.0},  # at equal compute: above vLLM "0"
             "2": res(95.0, 93.0, 80.0, tokens=((1, 2), (3, 5))) | {"rounds": []}}  # below vLLM's best; one row differs
    args = argparse.Namespace(requests=2, max_tokens=2, prompt_len=4, rank=16, compile="eager", repeats=1,
                              adapter_dtype="float32")
    text = bl.report({"loom": looms, "vllm": vllm, "adapter_bytes": 140_000_000}, args)

    def met(target: str) -> bool:
        lines = [ln for ln in text.splitlines() if ln.startswith(f"TARGET {target}: ")]
        assert len(lines) == 1, (target, text)
        return not lines[0].endswith("NOT met")

    assert met("at equal compute (loom 1t, vLLM 0): loom no-LoRA above vLLM's")
    assert met("at equal compute (loom 1t, vLLM 0): both adapter ratios above vLLM's")
    assert not met("at equal compute (loom 2t, vLLM 0,1): loom no-LoRA above vLLM's")
    assert met("at equal compute (loom 2t, vLLM 0,1): both adapter ratios above vLLM's")
    assert not met("loom no-LoRA above vLLM's (loom 2t, vLLM 0,1)")  # loom's best (2t) against vLLM's best
    assert not met("tokens identical 2/2 in every row")
    assert met("loom (1t): one adapter >= 0.95x") and not met("loom (1t): 2 distinct >= 0.85x loom's no-LoRA")
    assert "loom (1t)" in text and "loom (2t)" in text and "vllm 0,1 (2t)" in text and "vLLM 0.32.0:" in text
    # 2 requests x 2 tokens at 70 tok/s: 57.1 ms; one decode step reads 2 x 140 MB at 10 GB/s: 28 ms more -> 0.67
    assert "loom (1t): 2 distinct adapters read 280 MB a decode step" in text
    assert "cap the distinct ratio at 0.67" in text
    assert "(bound if read after the GEMMs 0.67)" in text
    assert "loom (2t): 2 distinct adapters" not in text  # no bandwidth measured for it
    # a ratio just below a target prints as below it
    near = bl.report({"loom": {"1": res(100.0, 94.99, 85.0) | {"rounds": []}}, "vllm": {}, "adapter_bytes": 0}, args)
    assert "TARGET loom (1t): one adapter >= 0.95x: 0.9499x NOT met" in near
    assert "TARGET loom (1t): 2 distinct >= 0.85x loom's no-LoRA: 0.8500x met" in near
    # a 16-bit model or 16-bit adapters: token identity with vLLM is not a target (rounding differs by construction)
    assert "float32 model, rank-16 float32 adapters" in text
    for looms16, ad in (({t: r | {"dtype": "bfloat16"} for t, r in looms.items()}, "float32"), (looms, "bfloat16")):
        text16 = bl.report({"loom": looms16, "vllm": vllm, "adapter_bytes": 0}, argparse.Namespace(**{
            **vars(args), "adapter_dtype": ad}))
        assert "TARGET tokens identical" not in text16
        assert "tokens identical to vLLM's: not asked" in text16


def test_bench_lora_vllm_computes_in_loom_dtype(monkeypatch):
    """vLLM's jobs (plain and LoRA engines) take the dtype loom resolved, not a fixed float32."""
    import argparse

    import bench_lora

    jobs = []
    monkeypatch.setattr(bench_lora, "run_vllm_settings", lambda args, job, progress, tag: jobs.append(job) or {})
    args = argparse.Namespace(max_tokens=3, rank=16, requests=2, repeats=1, vllm_threads=["0"])
    bench_lora.run_vllm(args, "m", "/root", "bfloat16", [[7], [8]], bench_lora.scenario_loras(2))
    assert len(jobs) == 2 and all(job["dtype"] == "bfloat16" for job in jobs)


def test_phase_times_split_prefill_from_decode_steps_and_the_report_subtracts_them():
    from bench_lora import phase_times

    from harness.lora_report import phase_line

    st = phase_times([(0.5, True), (0.1, True), (0.02, False), (0.04, False), (0.03, False)])
    assert st == {"prefill_ms": pytest.approx(600), "prefill_steps": 2, "decode_ms": pytest.approx(30),
                  "decode_steps": 3}
    assert phase_times([(0.5, True)])["decode_ms"] is None
    steps = {"no_lora": (600, 30), "one_adapter": (700, 32), "distinct_adapters": (750, 40)}
    res = {sc: {"steps": {"prefill_ms": p, "prefill_steps": 1, "decode_ms": d, "decode_steps": 31}}
           for sc, (p, d) in steps.items()} | {"stream_gb_s": 50.0}
    # 32 adapters x 10 MB at 50 GB/s: 6.4 ms; the distinct decode step added 10 ms
    line = phase_line("2", res, 32, 10_000_000)
    for part in ("prefill 600 / 700 / 750 ms", "+100 / +150 ms of prefill", "+2.0 / +10.0 ms a decode step",
                 "(320 MB) take 6.4 ms at 50.0 GB/s (1.56x that added)"):
        assert part in line, line
    del res["one_adapter"]["steps"]
    assert phase_line("2", res, 32, 10_000_000) is None  # a scenario without step times (an older JSON)


def test_distinct_ceiling_is_base_time_over_base_plus_reading_every_adapter_each_decode_step():
    from harness.adapter_cost import distinct_ceiling

    # 4 requests x 3 tokens at 120 tok/s: 0.1 s; 2 decode steps x 4 adapters x 0.5 GB at 40 GB/s: 0.1 s
    assert distinct_ceiling(120.0, 4, 3, 500_000_000, 40.0) == pytest.approx(0.5)
    assert distinct_ceiling(120.0, 4, 1, 500_000_000, 40.0) == 1.0  # one token: no decode step reads anything


def test_vllm_peer_runs_where_this_repository_is_not_importable(tmp_path, monkeypatch):
    """The vLLM peer runs from a folder where `python -m` / `-c` helpers (vLLM inspects models that way) do not find
    this repository's top-level kernels/ as a `kernels` package (transformers imports an installed `kernels` if it
    finds one; from the repository's root vLLM then refused every model). A stand-in peer reports where its own
    helper process finds `kernels`."""
    import harness.vllm_peer as pvc

    fake = tmp_path / "fake_peer.py"
    fake.write_text(
        "import json, os, subprocess, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "probe = 'import importlib.util; s = importlib.util.find_spec(\"kernels\"); print(s.origin if s else \"\")'\n"
        "seen = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True).stdout.strip()\n"
        "json.dump({'cwd': os.getcwd(), 'kernels_importable': seen}, open(out, 'w'))\n")
    monkeypatch.setattr(pvc, "PEER", fake)
    monkeypatch.chdir(ROOT)  # where the benchmarks are run from
    res = pvc.run_vllm_peer(sys.executable, {"job": 1}, timeout_s=120)
    assert Path(res["cwd"]).resolve() != ROOT
    seen = res["kernels_importable"]  # an installed Hugging Face `kernels` (transformers >= 5.25 needs it) is fine
    assert not seen or Path(seen).resolve().parent != ROOT / "kernels"


def test_bench_lora_load_during_smoke(tmp_path):
    """--load-during at its smallest (one round, the thread loader only: the loader process has its own tests):
    every phase's row and the two targets."""
    out = tmp_path / "load.json"
    p = run_script("bench_lora.py", "--load-during", "1", "--steady-steps", "1", "--requests", "2", "--prompt-len", "4",
                   "--loaders", str(1 << 62), "--json", str(out))
    for phase in ("steady", "load", "resident", "first_use"):
        assert f" {phase} " in p.stdout, p.stdout
    assert "TARGET thread: ITL p99 during load <= 1.05x" in p.stdout
    assert "TARGET thread: ITL p99 during first use <= 1.05x" in p.stdout
    ms = json.loads(out.read_text())["engines"]["thread"]["ms"]
    assert all(ms[phase]["n"] >= 1 for phase in ("steady", "load", "resident", "first_use"))


# ---- bench_lora_floor -------------------------------------------------------------------------------

def test_bench_lora_floor_smoke(tmp_path):
    out = tmp_path / "floor.json"
    p = run_script("bench_lora_floor.py", "--layers", "1", "--tokens", "4", "--rounds", "1", "--json", str(out))
    assert "added / floor" in p.stdout
    data = json.loads(out.read_text())
    # one adapter's rows counted projection by projection, rank x (in + out) float32 for each of the seven
    cfg = json.loads((Path(bc.default_model_dir()) / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_rank = sum(a + b for a, b in [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)])
    one = data["scenarios"]["one"]
    assert one["adapter_mb"] == pytest.approx(16 * per_rank * 4 / 1e6)
    assert one["lora_mflop"] == pytest.approx(2 * 4 * 16 * per_rank / 1e6)
    assert data["scenarios"]["distinct"]["adapter_mb"] == pytest.approx(4 * one["adapter_mb"])  # 4 tokens, 4 adapters
    for sc in data["scenarios"].values():
        assert sc["ms"] > 0 and sc["floor_ms"] > 0


# ---- bench_serving: pieces that need no server -----------------------------------------------------

def test_serving_config_rewrite():
    import harness.model_repo as mr

    text = (ROOT / "model_repository" / "loom_smollm2" / "config.pbtxt").read_text()
    params = mr.read_parameters(text)
    assert "adapter_roots" in params and "max_num_seqs" in params
    new = mr.set_parameters(text, {"adapter_roots": "/tmp/x", "max_num_seqs": "8", "brand_new": "1"})
    p2 = mr.read_parameters(new)
    assert p2["adapter_roots"] == "/tmp/x" and p2["max_num_seqs"] == "8" and p2["brand_new"] == "1"
    assert {k: v for k, v in p2.items() if k not in ("adapter_roots", "max_num_seqs", "brand_new")} == \
           {k: v for k, v in params.items() if k not in ("adapter_roots", "max_num_seqs")}


def test_serving_workload_and_arrivals():
    from transformers import AutoTokenizer

    import harness.serving_load as bs

    tok = AutoTokenizer.from_pretrained(bc.default_model_dir())
    reqs = bs.make_workload(tok, 20, 32, 0.5, 16, 0.25, seed=1)
    assert len(reqs) == 20
    assert all(12 <= r.max_tokens <= 20 for r in reqs)
    assert all(abs(r.prompt_len - 32) <= 20 for r in reqs) and len({r.prompt_len for r in reqs}) > 1
    assert bs.make_workload(tok, 5, 10, 0.0, 7, 0.0, seed=2)[0].max_tokens == 7
    assert [r.text for r in bs.make_workload(tok, 5, 10, 0.5, 7, 0.5, seed=3)] == \
           [r.text for r in bs.make_workload(tok, 5, 10, 0.5, 7, 0.5, seed=3)]
    assert bs.arrival_times(4, None, 0) == [0.0] * 4
    t = bs.arrival_times(2000, 10.0, 0)
    assert t == sorted(t) and 150 < t[-1] < 250  # mean gap 0.1 s


def test_serving_summary():
    import harness.serving_load as bs

    reqs = [bs.Req("a", 1, 3), bs.Req("b", 1, 2)]
    r0 = bs.Result(0, t_send=0.0, chunks=[(0.5, 1), (0.7, 2)], t_end=0.7)
    r1 = bs.Result(1, t_send=0.2, chunks=[(0.4, 1), (0.6, 1)], t_end=0.6)
    s = bs.summarize_run([r0, r1], reqs)
    assert s["ok"] == 2 and s["errors"] == 0 and s["wrong_token_count"] == 0 and s["output_tokens"] == 5
    assert s["ttft_s"]["p50"] == pytest.approx(0.35) and s["e2e_s"]["max"] == pytest.approx(0.7)
    assert s["itl_s"]["max"] == pytest.approx(0.2)  # r1: (0.4 - 0.2) / 1; r0: (0.7 - 0.5) / 2 = 0.1
    assert s["output_tok_s"] == pytest.approx(5 / 0.7)
    # the same requests again as a second round 100 s later: tokens/s over the two spans, not the gap between them
    r2 = bs.Result(0, t_send=100.0, chunks=[(100.5, 1), (100.9, 2)], t_end=100.9, round=1)
    r3 = bs.Result(1, t_send=100.0, chunks=[(100.1, 1), (100.3, 1)], t_end=100.3, round=1)
    s = bs.summarize_run([r0, r1, r2, r3], reqs)
    assert s["ok"] == 4 and s["output_tok_s"] == pytest.approx(10 / (0.7 + 0.9))


def test_serving_rounds_alternate_and_compare_per_round():
    import harness.serving_load as bs

    calls = []

    def runner(name, t_end):
        def run(k):
            calls.append((k, name))
            return [bs.Result(0, t_send=0.0, chunks=[(0.1 * (k + 1), 1), (t_end, 1)], t_end=t_end)]
        return run

    got = bs.alternating(3, {"triton": runner("triton", 2.0), "offline": runner("offline", 1.0)})
    assert calls == [(0, "triton"), (0, "offline"), (1, "offline"), (1, "triton"), (2, "triton"), (2, "offline")]
    assert [[r.round for r in rnd] for rnd in got["triton"]] == [[0], [1], [2]]
    rr = bs.round_ratios(got["triton"], got["offline"], [bs.Req("a", 1, 2)])
    assert rr["tok_s_ratio"] == pytest.approx([0.5] * 3) and rr["tok_s_ratio_median"] == pytest.approx(0.5)
    assert rr["ttft_p50_added_ms"] == pytest.approx([0.0] * 3)
    assert "median 0.50" in bs.round_line("c=1", rr)


def test_ttft_added_is_paired_request_by_request():
    """The TTFT a server adds is taken per request against the same request in-process in the same round, so the
    spread of prefill times between prompts does not enter it; failed or missing requests make no pair."""
    import harness.serving_load as bs

    def res(idx, ttft, error=None):
        return bs.Result(idx, t_send=10.0, chunks=[] if error else [(10.0 + ttft, 1)], t_end=11.0, error=error)

    # prefill times 0.1-0.9 s by prompt; the server adds 5 ms to each (request 3 failed on the server)
    tri = [[res(0, 0.105), res(1, 0.905), res(2, 0.505), res(3, 0.0, "boom")], [res(0, 0.106), res(1, 0.904)]]
    off = [[res(1, 0.900), res(0, 0.100), res(2, 0.500), res(3, 0.3)], [res(0, 0.100), res(1, 0.900)]]
    assert bs.paired_ttft_added(tri, off) == pytest.approx([5.0, 5.0, 5.0, 6.0, 4.0])
    rr = bs.round_ratios(tri, off, [bs.Req("a", 1, 1)] * 4)
    assert rr["ttft_pairs"] == 5 and rr["ttft_added_paired_ms_median"] == pytest.approx(5.0)
    assert "median +5.0 ms over 5 pairs" in bs.round_line("c=1", rr)


def test_aiperf_payload_template_renders_vllm_tensors():
    import jinja2

    from harness.aiperf import AIPERF_TEMPLATE

    env = jinja2.Environment()
    body = json.loads(env.from_string(AIPERF_TEMPLATE).render(text='say "hi"\n', max_tokens=32))
    assert body["text_input"] == 'say "hi"\n' and body["stream"] is True and body["exclude_input_in_output"] is True
    assert json.loads(body["sampling_parameters"]) == {"max_tokens": 32, "ignore_eos": True, "temperature": 0}


def test_make_adapters_loads_in_the_engine(tmp_path):
    from harness.lora import make_bench_adapters
    from loom.engine.llm import LLM
    from loom.engine.sampling_params import SamplingParams

    model_dir = bc.default_model_dir()
    names = make_bench_adapters(model_dir, tmp_path, 2, rank=8)
    assert names == ["bench-lora-000", "bench-lora-001"]
    llm = LLM(model_dir, adapter_roots=[str(tmp_path)], kv_cache_memory_bytes=64 << 20)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["The weather was cold this morning"] * 3, sp, lora_names=[None, names[0], names[1]])
    assert all(o.error is None and len(o.token_ids) == 6 for o in outs)
    assert outs[1].token_ids != outs[0].token_ids or outs[2].token_ids != outs[0].token_ids  # B is non-zero


# ---- demo_offline (a README entry point) ------------------------------------------------------------

def test_demo_offline_runs():
    p = run_script("demo_offline.py", "--max-tokens", "6")
    assert p.stdout.count("Q: ") == 6 and "prefix cache:" in p.stdout
    assert "each request run alone gives the same text: 6/6" in p.stdout  # preemption and batching change nothing
