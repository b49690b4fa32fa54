"""The start-up warm-up launches every Triton variant serving launches (so serving never compiles), checked on CPU
for sm_90: scripts/warmup_coverage.py records each launch's specialisation key as Triton's JIT would bind it,
during the warm-up and during a randomized serving workload, and fails on any variant the warm-up missed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_warmup_covers_every_variant_serving_launches():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "warmup_coverage.py"), "--scenarios",
                        "llama_lora,mixtral", "--steps", "150"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [r["scenario"] for r in lines] == ["llama_lora", "mixtral"], p.stdout + p.stderr[-3000:]
    for r in lines:
        assert r["missing"] == [], r
        # the workload reached what it is meant to: graph steps, preemption, LoRA/MoE variants beyond the base ones
        assert r["graph_steps"] > 20 and r["preemptions"] > 0 and r["serving_variants"] > 8, r
    assert p.returncode == 0, p.stderr[-3000:]


def test_warmup_plan_reaches_every_tile_class():
    """The plan's sizes: powers of two up to each limit and the limit (every class (a, 2a] holds one)."""
    from loom.engine.worker.warmup import lora_classes, powers_up_to
    from loom.kernels.lora import block_r_for

    assert powers_up_to(2048, 2) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert powers_up_to(100) == [1, 2, 4, 8, 16, 32, 64, 100]

    class R:  # what lora_classes reads of a runner
        max_num_tokens = 2048

        class config:
            max_lora_rank = 64

    sizes, ranks = lora_classes(R, capacity=1000)
    assert sizes == [1, 17, 33] and ranks == [16, 32, 64]
    assert {block_r_for(r) for r in ranks} == {block_r_for(r) for r in range(1, 65)}
    R.config.max_lora_rank = 100
    assert lora_classes(R, capacity=40)[1] == [16, 32, 40]  # ranks past the pool's rows cannot be served
