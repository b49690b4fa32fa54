#!/usr/bin/env python
"""One-shot GPU validation of loom: correctness against transformers / PEFT / the CPU sampler, memory and speed.

    python scripts/gpu_check.py --out DIR        # on a CUDA machine: at most BUDGET_S (450 s) by construction
    python scripts/gpu_check.py --cpu-smoke      # CI: every section's code path on CPU with tiny shapes
    python scripts/gpu_check.py --plan           # CPU dry run: each section's limit and Triton compile count

Sections (each in its own process, with a hard time limit; docs/GPU_CHECK.md says what each checks):
  kernels   every Triton kernel vs its reference, fp32/fp16/bf16, at serving shapes and with block ids near
            the top of a cache of more than 2^31 elements
  kernel_grid  the same over the CPU test grid (tests/kernels), bf16 included
  engine    the engine vs transformers: fp32 greedy tokens identical, bf16 logprobs and top-1 within tolerance
  lora      mixed adapters and no-adapter rows in one step vs PEFT; load / reload / unload
  sampler   the sampler on the GPU vs on the CPU with the same seeds
  memory    default KV sizing, start-up time, peak memory of the largest prefill and decode steps
  speed     1B-class random Llama: decode tokens/s and bandwidth fraction at batch 1/8/32/128, CUDA graphs vs
            eager, host vs device time per step, compiles after warm-up, 32 rank-16 adapters, paged decode
            attention vs a device copy and vs SDPA
  tp        (optional; 2+ GPUs, else "skipped: 1 GPU") TP=1 vs TP=2 on the 1B-class Llama: TP=2's greedy tokens
            with per-rank CUDA graphs = eager; decode tokens/s at batch 1 and 32 (TP=1 eager, TP=2 graphs and
            eager), collectives ms per step
  speed_8b  (optional) the same decode sweep for an 8B-class random Llama, CUDA graphs only
The section limits sum to at most BUDGET_S - MARGIN_S (asserted at import), so every section gets its whole limit
even when each one runs to it; the correctness sections also run side by side. One Triton cache
(TRITON_CACHE_DIR, default DIR/triton_cache) is shared by the sections and by reruns into the same DIR.
As each section ends, one JSON line goes to DIR/gpu_check.jsonl ("status": pass / fail / timeout / skipped: ...);
a summary table is printed last. Exit 1 if any section failed (2 for bad arguments); --strict also fails on
a missed speed target. The optional section not finishing ("skipped: time") is not a failure; a correctness
section's timeout is. Without CUDA (and without --cpu-smoke or --plan) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Section:
    name: str
    target: str  # module:function(recorder, options)
    limit_s: int  # hard limit on CUDA
    smoke_limit_s: int
    exclusive: bool  # timed sections run alone; correctness sections may share the GPU
    optional: bool = False  # extra numbers: not finishing for time is not a failure


# In run order: the correctness sections side by side, then the timed ones alone. memory starts the 1B engine with
# every default first, so speed's start-up finds the 1B variants in the shared Triton cache; speed (the 1B numbers)
# before the optional 8B sweep.
SECTIONS = [
    Section("kernels", "harness.gpu_kernels:run", 50, 150, False),
    Section("kernel_grid", "harness.gpu_kernels:run_grid", 65, 60, False),
    Section("engine", "harness.gpu_engine:run_engine", 115, 150, False),
    Section("lora", "harness.gpu_engine:run_lora", 20, 150, False),
    Section("sampler", "harness.gpu_sampler:run", 10, 60, False),
    Section("memory", "harness.gpu_perf:run_memory", 50, 60, True),
    Section("speed", "harness.gpu_perf:run_speed", 50, 90, True),
    Section("tp", "harness.gpu_tp:run_tp", 35, 120, True, optional=True),
    Section("speed_8b", "harness.gpu_perf:run_speed_8b", 25, 60, True, optional=True),
]
BUDGET_S = 450  # the whole CUDA run: with ~3 min of machine start it leaves room for a rerun in 15 min of device time
MARGIN_S = 30  # budget the limits leave unused: process start-up and scheduling between sections
SMOKE_BUDGET_S = 600
SOFT_MARGIN_S = 15  # a section stops starting checks this long before its hard limit
COMPILE_S = 1.0  # --plan's assumption: seconds per cold Triton compile of one variant for sm_90 (not measured here)


def soft_margin(limit: float) -> float:
    """How long before its hard limit a section stops starting checks."""
    return min(SOFT_MARGIN_S, limit / 5)


def limits_fit(sections: list[Section], budget: float, margin: float) -> bool:
    return sum(s.limit_s for s in sections) <= budget - margin


assert limits_fit(SECTIONS, BUDGET_S, MARGIN_S), "gpu_check's section limits must sum below its budget"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="every section on CPU with tiny shapes (CI)")
    ap.add_argument("--plan", action="store_true", help="dry run on CPU: per section its limit and the Triton "
                    "variants it makes a GPU compile (recorded for sm_90, nothing run), the budget and the margin")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_check"), help="folder for gpu_check.jsonl and logs")
    ap.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                    help="comma-separated subset, in the standard order")
    ap.add_argument("--budget", type=float, default=0, help=f"seconds for the whole run (default: {BUDGET_S} on "
                    f"CUDA, {SMOKE_BUDGET_S} with --cpu-smoke); a section gets min(its limit, what is left)")
    ap.add_argument("--triton-cache", default="", help="TRITON_CACHE_DIR for every section (default: OUT/triton_cache; "
                    "a rerun into the same folder loads its compiled kernels)")
    ap.add_argument("--limit", type=float, default=0, help="cap every section's hard limit at this many seconds "
                    "(reruns of one section; tests of the time limit)")
    ap.add_argument("--jobs", type=int, default=0, help="correctness sections run at once (default 5; smoke 2)")
    ap.add_argument("--model-dir", default="", help="also check this checkpoint (engine: fp32 greedy vs "
                    "transformers) and time it (speed)")
    ap.add_argument("--strict", action="store_true", help="a missed speed/memory target fails the run")
    return ap.parse_args(argv)


def _preimport(sections: list[Section]) -> None:
    """Smoke mode forks each section from this process: import what they need once, before any fork."""
    import importlib

    mods = list(dict.fromkeys(s.target.split(":")[0] for s in sections))
    for mod in mods + (["peft"] if any(s.name == "lora" for s in sections) else []):
        try:
            importlib.import_module(mod)
        except ImportError as e:  # the section's own process imports it again and records the failure
            print(f"pre-import of {mod} failed: {e}", file=sys.stderr)


class Runner:
    def __init__(self, args, device: str, out: Path, work: Path):
        from harness.gpu_report import Options, child_main

        self.args, self.device, self.out, self.work = args, device, out, work
        self.smoke = args.cpu_smoke
        self.Options, self.child_main = Options, child_main
        self.ctx = mp.get_context("fork" if self.smoke else "spawn")  # never fork a process that touched CUDA
        budget = args.budget or (SMOKE_BUDGET_S if self.smoke else BUDGET_S)
        self.end = time.time() + budget
        self.jsonl = out / "gpu_check.jsonl"
        self.log = out / "gpu_check.log"
        self.records: list[dict] = []

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        with open(self.log, "a") as f:
            f.write(msg + "\n")

    def start(self, sec: Section):
        own = sec.smoke_limit_s if self.smoke else sec.limit_s
        if self.args.limit:
            own = min(own, self.args.limit)
        left = self.end - time.time()
        if left < min(own, 20):  # too little of the run's budget left to prove anything
            return None, left
        limit = min(own, left)
        opts = self.Options(smoke=self.smoke, device=self.device, work_dir=str(self.work), log_path=str(self.log),
                            model_dir=self.args.model_dir, deadline=time.time() + limit - soft_margin(limit),
                            optional=sec.optional)
        paths = (str(self.work / f"{sec.name}.partial.json"), str(self.work / f"{sec.name}.result.json"))
        p = self.ctx.Process(target=self.child_main, args=(sec.name, sec.target, opts, *paths), name=sec.name)
        p.start()
        self.say(f"== {sec.name}: started (hard limit {limit:.0f}s)")
        return (p, time.time(), time.time() + limit, paths), limit

    def finish(self, sec: Section, run) -> None:
        p, t0, hard, (partial, result) = run
        timed_out = p.is_alive()
        if timed_out:  # the hard limit: stop it, keep what it recorded so far
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        rec = None
        for path in ([partial] if timed_out else [result, partial]):  # a killed section: what it had recorded
            try:
                rec = json.loads(Path(path).read_text())
                break
            except (OSError, ValueError):
                continue
        rec = rec or {"section": sec.name, "device": self.device, "smoke": self.smoke, "checks": []}
        rec["optional"] = sec.optional
        if timed_out:
            rec["status"] = "skipped: time" if sec.optional else "timeout"
            rec["error"] = f"killed at its hard limit of {hard - t0:.0f}s" + \
                (" (optional section: not a failure)" if sec.optional else "")
        elif not Path(result).is_file():
            rec["status"] = "fail"
            rec["error"] = f"the section's process ended with exit code {p.exitcode} before writing its record"
        rec["seconds"] = round(time.time() - t0, 1)
        self.emit(rec)

    def emit(self, rec: dict) -> None:
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.records.append(rec)
        self.say(f"== {rec['section']}: {rec['status']} ({rec.get('seconds', 0):.0f}s)")

    def run(self, sections: list[Section]) -> list[dict]:
        jobs = self.args.jobs or (2 if self.smoke else 5)
        queue, running = list(sections), {}
        while queue or running:
            while queue and len(running) < jobs and not (queue[0].exclusive and running) and \
                    not any(s.exclusive for s in running):
                sec = queue.pop(0)
                run, limit = self.start(sec)
                if run is None:
                    self.emit({"section": sec.name, "status": "skipped: time" if sec.optional else "timeout",
                               "optional": sec.optional, "device": self.device, "smoke": self.smoke, "seconds": 0.0,
                               "checks": [], "error": f"not started: {max(limit, 0):.0f}s of the run's budget left"})
                else:
                    running[sec] = run
            if not running:
                continue
            wait = max(0.0, min(r[2] for r in running.values()) - time.time())
            mp.connection.wait([r[0].sentinel for r in running.values()], timeout=wait)
            for sec, run in list(running.items()):
                if not run[0].is_alive() or time.time() >= run[2]:
                    run[0].join(1)
                    self.finish(sec, run)
                    del running[sec]
        order = [s.name for s in sections]
        return sorted(self.records, key=lambda r: order.index(r["section"]))


def _plan_child(sec: Section, opts, log: str, partial: str, result: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # warnings and progress bars: to the plan's log
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from harness.gpu_report import plan_main

    plan_main(sec.name, sec.target, opts, partial, result)


def plan_rows(sections: list[Section], variants: dict[str, list[str]]) -> list[dict]:
    """Per section: its limit, the variants it launches, and the estimated cold-compile seconds against the
    limit. Sections side by side start together, so each compiles all of its own; a section that runs alone
    after other timed ones finds theirs in the shared Triton cache (speed starts the 1B engine memory started),
    so only its `new` variants count."""
    seen: set[str] = set()
    rows = []
    for sec in sections:
        keys = variants.get(sec.name)
        new = None
        if keys is not None:
            new = len(set(keys) - seen) if sec.exclusive else len(set(keys))
            if sec.exclusive:
                seen.update(keys)
        est = None if new is None else new * COMPILE_S
        rows.append({"section": sec.name, "limit_s": sec.limit_s, "runs": "alone" if sec.exclusive else "side by side",
                     "optional": sec.optional, "variants": None if keys is None else len(keys), "new": new,
                     "compile_s": est, "fits": est is not None and est <= sec.limit_s - soft_margin(sec.limit_s)})
    return rows


def plan(args, sections: list[Section]) -> int:
    """--plan: each section's code path on CPU (fork, one at a time) with its Triton launches recorded for sm_90,
    at the CUDA run's structure (dtypes, models, batch sizes, engine limits) and CPU-sized dims where the CUDA
    shapes would not fit a CPU (kernels' serving and top-of-cache shapes, the 1B/8B models: see Options.plan)."""
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: real @jit functions are recorded
    os.environ["LOOM_FORCE_TRITON"] = "1"  # CPU tensors take the Triton launchers; the engine's warm-up runs
    from harness.gpu_report import Options

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check_plan.log"
    log.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="loom_gpu_plan_"))
    ctx = mp.get_context("fork")
    variants: dict[str, list[str]] = {}
    try:
        _preimport(sections)
        for sec in sections:
            opts = Options(smoke=True, plan=True, device="cpu", work_dir=str(work), log_path=str(log), model_dir="",
                           deadline=time.time() + 3600, optional=sec.optional)
            result = work / f"{sec.name}.plan.json"
            p = ctx.Process(target=_plan_child, args=(sec, opts, str(log), str(work / f"{sec.name}.partial.json"),
                                                      str(result)))
            t = time.time()
            p.start()
            p.join(args.limit or 900)
            if p.is_alive():
                p.kill()
                p.join()
            try:
                variants[sec.name] = json.loads(result.read_text())["variants"]
            except (OSError, ValueError, KeyError):
                print(f"{sec.name}: the dry run ended without a record (exit code {p.exitcode}; see {log})",
                      file=sys.stderr)
            print(f"  {sec.name}: recorded in {time.time() - t:.0f}s", file=sys.stderr, flush=True)
    finally:
        from harness.random_llama import remove_scratch

        remove_scratch(work)
        shutil.rmtree(work, ignore_errors=True)
    rows = plan_rows(sections, variants)
    budget = args.budget or BUDGET_S
    total = sum(s.limit_s for s in sections)
    serial = max((s.limit_s for s in sections if not s.exclusive), default=0) + \
        sum(s.limit_s for s in sections if s.exclusive)
    head = f"{'section':<13}{'limit s':>8}  {'runs':<13}{'variants':>9}{'new':>6}{'compile s':>11}  fits"
    lines = [f"gpu_check plan (CPU dry run; Triton {_triton_version()}, variants recorded for sm_90)", head]
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
        lines.append(f"{r['section']:<13}{r['limit_s']:>8}  {r['runs']:<13}{fmt(r['variants']):>9}{fmt(r['new']):>6}"
                     f"{fmt(r['compile_s']):>11}  " + ("yes" if r["fits"] else "NO") +
                     (" (optional)" if r["optional"] else ""))
    lines += [f"budget {budget:g}s; section limits sum to {total}s: margin {budget - total:g}s "
              f"(at least {MARGIN_S}s by construction for the full run); with the correctness sections side by "
              f"side the run ends within {serial}s",
              f"compile s = new variants x {COMPILE_S:g}s (assumed cold sm_90 compile); fits = that ends before the "
              f"section's soft deadline ({SOFT_MARGIN_S}s before its limit, a fifth of it if less)",
              "variants: counted at the CUDA run's dtypes, models and engine limits, at CPU-sized dims where the "
              "CUDA shapes do not fit a CPU (kernels, 1B/8B models)"]
    for line in lines:
        print(line)
    (out / "gpu_check_plan.txt").write_text("\n".join(lines) + "\n")
    (out / "gpu_check_plan.json").write_text(json.dumps({"budget_s": budget, "limits_sum_s": total, "rows": rows}))
    ok = len(variants) == len(sections) and all(r["fits"] for r in rows) and total <= budget
    return 0 if ok else 1


def _triton_version() -> str:
    import triton

    return triton.__version__


def section_failed(rec: dict) -> bool:
    """Not passing is a failure, except an optional section not finishing for time and a section that does not
    apply to the device ("skipped: 1 GPU")."""
    from harness.gpu_report import status_ok

    return not status_ok(rec["status"], rec.get("optional", False))


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = sorted(set(names) - {s.name for s in SECTIONS})
    if unknown:
        print(f"unknown sections {unknown}; known: {[s.name for s in SECTIONS]}", file=sys.stderr)
        return 2
    sections = [s for s in SECTIONS if s.name in names]
    if args.plan:
        return plan(args, sections)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels section runs it
        device = "cpu"
    else:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("TRITON_INTERPRET=1 is set: a CUDA check needs compiled kernels; unset it", file=sys.stderr)
            return 2
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device present: nothing to check (use --cpu-smoke to exercise the script on CPU)")
            return 0
        device = "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("gpu_check.jsonl", "gpu_check.log", "gpu_check_summary.txt"):
        (out / f).unlink(missing_ok=True)
    # one Triton cache for every section (spawned children inherit it) and for reruns into the same --out
    os.environ["TRITON_CACHE_DIR"] = str(Path(args.triton_cache or out / "triton_cache").resolve())
    work = Path(tempfile.mkdtemp(prefix="loom_gpu_check_"))
    t0 = time.time()
    try:
        if args.cpu_smoke:
            _preimport(sections)
        runner = Runner(args, device, out, work)
        header = f"gpu_check on {device}" + (" (CPU smoke: tiny shapes, references)" if args.cpu_smoke else "")
        if device == "cuda":  # the device's name comes from the sections: this process leaves CUDA uninitialised
            import torch

            header += f", torch {torch.__version__}"
        runner.say(header)
        records = runner.run(sections)
    finally:
        from harness.random_llama import remove_scratch

        remove_scratch(work)
        shutil.rmtree(work, ignore_errors=True)
    from harness.gpu_report import summary_lines

    failed = [r["section"] for r in records if section_failed(r)]
    missed = [f"{r['section']}: {t['name']}" for r in records for t in r.get("targets", []) if t["met"] is False]
    lines = summary_lines(records)
    lines.append("")
    lines.append(f"total {time.time() - t0:.0f}s; " + (f"FAILED sections: {', '.join(failed)}" if failed
                                                      else "all sections passed"))
    if missed:
        lines.append(f"targets missed: {len(missed)}" + (" (--strict: counted as a failure)" if args.strict else ""))
    for line in lines:
        runner.say(line)
    (out / "gpu_check_summary.txt").write_text("\n".join(lines) + "\n")
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
