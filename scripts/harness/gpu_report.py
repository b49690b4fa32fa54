"""Records of scripts/gpu_check.py's sections: each check's status and data, tables, targets.

A section runs in its own process with a Recorder; the record is rewritten to a file after every check, so a
section killed at its time limit still reports what it finished. The parent turns each record into one JSON line.
Statuses: "pass", "fail", "timeout", "skipped: <why>". Only "skipped: not implemented" (an interface another change
adds later) and "skipped: n/a ..." (no meaning on this device) are not failures; "skipped: time" is one, except in
an optional section (Options.optional).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

NOT_IMPLEMENTED = "not implemented"
ONE_GPU = "1 GPU"  # a section that needs several GPUs, on a device with one (or none): skipped, not failed


class Skip(Exception):
    """Raised inside a check: it did not run, for the reason given."""


def status_ok(status: str, optional: bool = False) -> bool:
    """A check's status that is not a failure; in an optional section (the 8B sweep) "skipped: time" is not one
    either."""
    return status == "pass" or status.startswith((f"skipped: {NOT_IMPLEMENTED}", "skipped: n/a", "skipped: 0 GPU",
                                                  f"skipped: {ONE_GPU}")) or \
        (optional and status == "skipped: time")


@dataclass
class Options:
    """What every section gets (plain values: it crosses a process boundary)."""
    smoke: bool
    device: str
    work_dir: str
    log_path: str
    model_dir: str
    deadline: float  # time.time() after which a section starts no new check (its hard limit is later)
    plan: bool = False  # gpu_check --plan: the CUDA run's structure (dtypes, models, batches) at CPU-sized shapes,
    # the Triton launches recorded for sm_90 and not run (harness.triton_variants); checks' results mean nothing
    optional: bool = False  # a check not started for time is not a failure (the section's numbers are extras)


def _clean(v):
    """JSON-ready, floats to 5 significant digits (the lines stay readable)."""
    if isinstance(v, float):
        return None if not math.isfinite(v) else float(f"{v:.5g}")
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if hasattr(v, "item"):  # a 0-d tensor or numpy scalar
        return _clean(v.item())
    return str(v)


def write_json_atomic(path: Path, obj) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class Recorder:
    def __init__(self, section: str, opts: Options, partial_path: Path | None):
        self.opts = opts
        self.partial_path = partial_path
        self.t0 = time.time()
        self.rec = {"section": section, "status": "running", "device": opts.device, "smoke": opts.smoke,
                    "optional": opts.optional, "seconds": 0.0, "checks": [], "metrics": {}, "tables": {}, "targets": []}

    # ---- output -------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        line = f"[{self.rec['section']} {time.time() - self.t0:6.1f}s] {msg}"
        if not self.opts.plan:  # --plan: the checks' results mean nothing, its table is the output
            print(line, flush=True)
        if self.opts.log_path:
            with open(self.opts.log_path, "a") as f:
                f.write(line + "\n")

    def flush(self) -> None:
        self.rec["seconds"] = round(time.time() - self.t0, 1)
        if self.partial_path is not None:
            write_json_atomic(self.partial_path, self.rec)

    # ---- content ------------------------------------------------------------------------------
    def time_left(self) -> float:
        return self.opts.deadline - time.time()

    def run(self, name: str, fn, *args, **kwargs):
        """Run one check: fn's dict result is recorded as its data; AssertionError or any other exception is a
        failure (the traceback goes to the log), Skip a skip. Past the deadline it is not started ("skipped:
        time", a failure). Returns fn's result, or None when it did not pass."""
        entry = {"name": name}
        result = None
        if self.time_left() <= 0:
            entry["status"] = "skipped: time"
        else:
            t = time.time()
            try:
                result = fn(*args, **kwargs)
                entry["status"] = "pass"
                if isinstance(result, dict):
                    entry["data"] = _clean(result)
            except Skip as e:
                entry["status"] = f"skipped: {e}"
            except Exception as e:  # noqa: BLE001 - every failure is recorded and the section goes on
                entry["status"] = "fail"
                entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                self.say("".join(traceback.format_exception(e)).rstrip())
            entry["seconds"] = round(time.time() - t, 2)
        self.rec["checks"].append(entry)
        detail = entry.get("error") or json.dumps(entry.get("data", ""))[:160]
        self.say(f"{entry['status']:<6} {name}  {detail}")
        self.flush()
        return result if entry["status"] == "pass" else None

    def metric(self, key: str, value) -> None:
        self.rec["metrics"][key] = _clean(value)
        self.flush()

    def table(self, title: str, columns: list[str]) -> None:
        self.rec["tables"].setdefault(title, {"columns": columns, "rows": []})

    def row(self, title: str, values: list) -> None:
        self.rec["tables"][title]["rows"].append(_clean(values))
        self.flush()

    def target(self, name: str, value, op: str, threshold: float, note: str = "") -> None:
        """A goal (docs/GPU_CHECK.md, Targets): recorded with met true/false (null when not measured here). Missed
        targets fail the run only with --strict."""
        met = None
        if value is not None and not self.opts.smoke and self.opts.device == "cuda":
            met = bool(value >= threshold) if op == ">=" else bool(value <= threshold)
        self.rec["targets"].append(_clean({"name": name, "value": value, "op": op, "threshold": threshold,
                                           "met": met, "note": note}))
        self.flush()

    def skip_section(self, reason: str) -> None:
        """The whole section does not apply here (e.g. "1 GPU"): its status becomes "skipped: <reason>"."""
        self.rec["skipped"] = reason
        self.say(f"skipped: {reason}")
        self.flush()

    def finish(self, error: str | None = None) -> dict:
        if error:
            self.rec["error"] = error[:500]
        bad = [c for c in self.rec["checks"] if not status_ok(c["status"], self.opts.optional)]
        self.rec["status"] = "fail" if (bad or error) else \
            f"skipped: {self.rec['skipped']}" if self.rec.get("skipped") else "pass"
        self.flush()
        return self.rec


def child_main(section: str, target: str, opts: Options, partial_path: str, result_path: str) -> None:
    """Entry of a section's process: run `module:function`(recorder, opts) and write the final record."""
    if opts.smoke:
        import torch

        torch.set_num_threads(1)  # tiny shapes, sections side by side: more threads only contend
    rec = Recorder(section, opts, Path(partial_path))
    if opts.device == "cuda":
        import torch

        rec.rec["device_name"] = torch.cuda.get_device_name()
    rec.flush()
    error = None
    try:
        mod, fn = target.split(":")
        getattr(importlib.import_module(mod), fn)(rec, opts)
    except Exception as e:  # noqa: BLE001 - a section that breaks outside a check still reports
        error = f"{type(e).__name__}: {e}"
        rec.say("".join(traceback.format_exception(e)).rstrip())
    write_json_atomic(Path(result_path), rec.finish(error))


def plan_main(section: str, target: str, opts: Options, partial_path: str, result_path: str) -> None:
    """gpu_check --plan: the section's code path on CPU with every Triton launch recorded as the sm_90 variant a
    GPU would compile (harness.triton_variants: nothing is compiled or run; TRITON_INTERPRET unset and
    LOOM_FORCE_TRITON=1, so the engine's warm-up runs as on CUDA). The record gets `variants`: the distinct keys."""
    from harness.triton_variants import VariantRecorder

    with VariantRecorder() as vr:
        child_main(section, target, opts, partial_path, result_path)
    rec = json.loads(Path(result_path).read_text())
    rec["variants"] = sorted(repr(k) for k in vr.keys)
    rec["launches"] = vr.launches
    write_json_atomic(Path(result_path), rec)


# ---- the summary the parent prints last ---------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


def summary_lines(records: list[dict]) -> list[str]:
    names = sorted({r["device_name"] for r in records if r.get("device_name")})
    out = ["", f"device: {', '.join(names) or records[0]['device'] if records else '-'}",
           f"{'section':<13}{'status':<30}{'seconds':>8}  checks (pass / fail / skipped)"]
    for r in records:
        st = [c["status"] for c in r.get("checks", [])]
        npass = sum(s == "pass" for s in st)
        nfail = sum(not status_ok(s, r.get("optional", False)) for s in st)
        out.append(f"{r['section']:<13}{r['status']:<30}{r.get('seconds', 0):>8.1f}  {npass} / {nfail} / "
                   f"{len(st) - npass - nfail}" + (f"   {r['error'][:80]}" if r.get("error") else ""))
    for r in records:
        for title, t in r.get("tables", {}).items():
            if not t["rows"]:
                continue
            cols = t["columns"]
            cells = [[_fmt(v) for v in row] for row in t["rows"]]
            w = [max(len(c), *(len(row[i]) for row in cells)) + 2 for i, c in enumerate(cols)]
            out += ["", f"{r['section']}: {title}", "".join(c.rjust(w[i]) for i, c in enumerate(cols))]
            out += ["".join(v.rjust(w[i]) for i, v in enumerate(row)) for row in cells]
    targets = [(r["section"], t) for r in records for t in r.get("targets", [])]
    if targets:
        out += ["", "targets (met is judged on a CUDA run only):"]
        for sec, t in targets:
            met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
            out.append(f"  {met:<7}{sec + ': ' + t['name']:<62} {_fmt(t['value']):>10} {t['op']} "
                       f"{_fmt(t['threshold'])}  {t.get('note', '')}")
    fails = [(r["section"], c) for r in records for c in r.get("checks", [])
             if not status_ok(c["status"], r.get("optional", False))]
    if fails:
        out += ["", "failed checks:"]
        out += [f"  {sec}: {c['name']}: {c['status']} {c.get('error', '')}" for sec, c in fails]
    return out

