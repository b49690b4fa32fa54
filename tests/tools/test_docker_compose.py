"""docker-compose.yml cannot run here (no Docker, no GPU): check what can be checked without running it."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["loom"]


def test_every_mounted_path_exists():
    svc = _compose()
    for vol in svc["volumes"]:
        host = vol.split(":")[0]
        assert host.startswith("./"), f"{vol}: mount paths relative to the repository"
        assert (REPO / host).exists(), f"{vol}: {host} does not exist (the model cache comes from scripts/setup.sh)"
    dockerfile = svc["build"]["dockerfile_inline"]
    assert "FROM ${TRITON_IMAGE}" in dockerfile and "backends/loom/model.py" in dockerfile


def test_command_is_the_documented_one():
    svc = _compose()
    cmd = svc["command"]
    cmd = " ".join(cmd) if isinstance(cmd, list) else cmd
    doc = (REPO / "docs" / "TRITON_BACKEND.md").read_text()
    blocks, cur = [], None
    for line in doc.splitlines():  # fenced code blocks
        if line.startswith("```"):
            if cur is None:
                cur = []
            else:
                blocks.append("\n".join(cur))
                cur = None
        elif cur is not None:
            cur.append(line)
    assert any(b.strip() == cmd for b in blocks), f"docs/TRITON_BACKEND.md must show the command {cmd!r}"
    assert shlex.split(cmd)[0] == "tritonserver" and "--model-repository=/models" in cmd


def test_mounts_match_what_the_image_expects():
    svc = _compose()
    targets = {v.split(":")[1] for v in svc["volumes"]}
    # the shipped model's adapter root (relative to its folder) is mounted writable inside the container
    cfg = (REPO / "model_repository" / "loom_smollm2" / "config.pbtxt").read_text()
    root = re.search(r'key: "adapter_roots", value: \{ string_value: "([^"]*)"', cfg).group(1)
    assert "/models" in targets and str(Path("/models/loom_smollm2", root)) in targets
    env = dict(e.split("=", 1) for e in svc["environment"])
    assert f"./.cache/models:{env['LOOM_MODEL_CACHE']}" in svc["volumes"]
    image_arg = svc["build"]["args"]["TRITON_IMAGE"]
    major, minor = map(int, re.search(r":(\d+)\.(\d+)-py3$", image_arg).groups())
    assert (major, minor) > (24, 10), "2.51 (24.10) has the cancellation crash"
    assert "health/ready" in " ".join(svc["healthcheck"]["test"])
    assert (REPO / "model_repository" / "loom_smollm2" / "1").is_dir()
