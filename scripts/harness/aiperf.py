"""NVIDIA's aiperf beside bench_serving's own load generator (scripts/bench_serving.py --mode aiperf): aiperf installed
into its own venv once, run against Triton's HTTP generate_stream endpoint with a payload template that speaks
vllm_backend's tensors, and its metrics read back."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import harness.bench as bc

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = bc.REPO_ROOT / ".cache" / "aiperf-venv"


def ensure_aiperf() -> Path:
    exe = AIPERF_VENV / "bin" / "aiperf"
    if exe.is_file():
        return exe
    bc.progress(f"aiperf: installing aiperf=={AIPERF_VERSION} into {AIPERF_VENV} (once; about 1.2 GB)")
    AIPERF_VENV.parent.mkdir(parents=True, exist_ok=True)
    base_python = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
    subprocess.run([base_python, "-m", "venv", str(AIPERF_VENV)], check=True)
    subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    if not exe.is_file():
        raise RuntimeError(f"aiperf was installed but {exe} is missing")
    return exe


AIPERF_TEMPLATE = """{
  "text_input": {{ text|tojson }},
  "stream": true,
  "exclude_input_in_output": true,
  "sampling_parameters": {{ {"max_tokens": max_tokens, "ignore_eos": true, "temperature": 0}|tojson|tojson }}
}
"""


def run_aiperf(http_url: str, model: str, tokenizer_dir: str, args, workdir: Path) -> dict:
    exe = ensure_aiperf()
    template = workdir / "payload_template.jinja"
    template.write_text(AIPERF_TEMPLATE)
    artifacts = workdir / "aiperf-artifacts"
    cmd = [str(exe), "profile", "-m", model, "--endpoint-type", "template", "--url", f"http://{http_url}",
           "--endpoint", f"/v2/models/{model}/generate_stream", "--streaming",
           "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output",
           "--tokenizer", tokenizer_dir, "--isl", str(args.aiperf_isl), "--isl-stddev", "0",
           "--osl", str(args.aiperf_osl), "--osl-stddev", "0", "--concurrency", str(args.aiperf_concurrency),
           "--request-count", str(args.aiperf_requests), "--warmup-request-count", "2",
           "--num-dataset-entries", "20", "--random-seed", str(args.seed + 1), "--ui", "simple",
           "--artifact-dir", str(artifacts)]
    env = dict(os.environ)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # a local folder is refused as a repo id when offline
        env.pop(k, None)
    tmp = workdir / "aiperf-tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env["AIPERF_DATASET_MMAP_BASE_PATH"] = str(tmp)
    bc.progress("aiperf: " + " ".join(cmd))
    proc = subprocess.run(cmd, env=env, cwd=str(workdir), capture_output=True, text=True, timeout=3600)
    out = proc.stdout + proc.stderr
    (workdir / "aiperf.log").write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf exited with {proc.returncode}:\n{out[-3000:]}")
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    data = json.loads(exports[-1].read_text()) if exports else {}
    # its console table: the box-drawn lines
    table_lines, inside = [], False
    for ln in proc.stdout.splitlines():
        inside = inside or ln.lstrip().startswith("┏")
        if inside:
            table_lines.append(ln)
            if ln.lstrip().startswith("└"):
                break
    return {"command": cmd, "console_table": "\n".join(table_lines), "export": data,
            "export_path": str(exports[-1]) if exports else None}


def aiperf_metric(export: dict, name: str, stat: str):
    m = export.get(name)
    if isinstance(m, dict):
        v = m.get(stat)
        return float(v) if isinstance(v, (int, float)) else None
    return None

