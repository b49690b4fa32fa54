"""scripts/kernel_resources.py: the serving kernels compiled for sm_90 in bf16 (no GPU) use no local memory (no
spills) and keep the occupancy their tile tables were designed for (kernels/paged_decode_attention.py DECODE_TILES,
kernels/paged_prefill_attention.py prefill_tiles, kernels/moe.py _k_tiles); and the report does see spills."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPTS = ROOT / "scripts"


def _run(args):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOOM_TEST_DEVICE")}
    return subprocess.run([sys.executable, *args], cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=600)


def test_serving_kernels_sm90_bf16_no_spills_and_designed_occupancy(tmp_path):
    out = tmp_path / "rows.jsonl"
    p = _run(["kernel_resources.py", "--sm", "90", "--dtypes", "bf16", "--groups", "decode,prefill,moe",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    seen = {(r["kernel"], r["tiles"].get("D_PAD"), r["tiles"].get("BLOCK_M"), r["tiles"].get("SPLIT", False))
            for r in rows}
    for d in (64, 128, 256):
        assert {("_decode_kernel", d, None, False), ("_decode_kernel", d, None, True)} <= seen, d
        assert ("_prefill_kernel", d, 16, False) in seen and ("_prefill_kernel", d, 32, False) in seen, d
    assert {("_gate_up_kernel", None, bm, False) for bm in (16, 32, 64)} <= seen
    for r in rows:
        what = f"{r['kernel']} [{r['config']}]"
        assert r["sm"] == 90 and r["dtype"] == "bf16", what
        assert r["spill_stores"] == r["spill_loads"] == r["stack"] == 0, f"{what} spills: {r}"
        assert 0 < r["regs"] <= 255 and r["ctas_per_sm"] >= 1, what
        t = r["tiles"]
        if r["kernel"] == "_decode_kernel":  # stream K/V: >= 3 CTAs (4 at head_dim 128 in a single pass; the split
            # grid has ~2 programs per SM), >= 24 KB of tiles in flight
            assert r["ctas_per_sm"] >= (4 if t["D_PAD"] == 128 and not t.get("SPLIT") else 3), what
            assert r["ctas_per_sm"] * t["BLOCK_N"] * t["D_PAD"] * 2 * 2 >= 24 * 1024, what
        elif r["kernel"] == "_prefill_kernel":
            assert r["ctas_per_sm"] * r["num_warps"] >= 8, what
        elif r["kernel"] == "_gate_up_kernel" and t["BLOCK_M"] == 16:  # decode-sized: streams the expert weights
            assert r["ctas_per_sm"] * r["num_warps"] >= 16, what
    assert "spilling 16-bit variants of decode,prefill,moe: none" in p.stdout


SPILLING = """
import json, torch
import kernel_compile_check as kcc, kernel_resources as kr
kcc.targets[:] = [t for t in kcc.TARGETS if t.arch == 90]
kcc._launching.update(group="decode", dtype="bf16")
q, kc = torch.zeros(2, 8, 128, dtype=torch.bfloat16), torch.zeros(8, 2, 16, 128, dtype=torch.bfloat16)
bt, sl = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
kcc.pda.paged_decode_attention_triton(q, kc, kc, bt, sl, 0.1, num_splits=1, block_n=64)
r = kr.resources(kcc.compiled[-1])
print(json.dumps(dict(r.__dict__, bad=kr.spilling([r], ["decode"]) == [r])))
"""


def test_report_sees_spills():
    """The decode kernel's former tile at head_dim 128 (64 keys, 4 warps) spills on sm_90: the report must say so."""
    p = _run(["-c", SPILLING])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads(p.stdout.splitlines()[-1])
    assert r["tiles"]["BLOCK_N"] == 64 and r["regs"] == 255, r
    assert r["spill_stores"] > 0 and r["spill_loads"] > 0 and r["stack"] > 0 and r["bad"], r
    assert r["ctas_per_sm"] == 2 and r["limit"] == "regs", r  # 255 registers x 128 threads: 2 CTAs of 65536
