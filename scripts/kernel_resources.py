"""Registers, spills, shared memory and occupancy of every compiled Triton kernel variant, without a GPU.

Compiles the variants exactly as scripts/kernel_compile_check.py does (its launch groups: the launchers called with
serving shapes and the forced tiles), then reads each cubin with the CUDA tools shipped in the triton wheel:
`cuobjdump --dump-resource-usage` (REG; STACK + LOCAL = per-thread local memory, where spills go) and the SASS
(`cuobjdump -sass`: spill stores/loads = the bytes of the STL/LDL instructions, what `ptxas -v` reports). Shared
memory is triton's launch-time dynamic allocation (metadata.shared) plus the cubin's static SHARED.

Occupancy (CTAs per SM) is the least of: registers (allocated per warp in units of 256, 65536 per SM), shared memory
(per SM: sm_80 164 KiB, sm_90 228 KiB; 1 KiB reserved per CTA), threads (2048 per SM) and 32 CTAs per SM.

Usage: python scripts/kernel_resources.py [--dtypes bf16,fp16,fp32] [--groups decode,prefill,...] [--sm 80,90]
       [--json FILE] [--no-spills GROUPS]   (exit 1 when a variant of GROUPS in a 16-bit dtype spills)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import kernel_compile_check as kcc
from triton import knobs

SM = {  # per-SM limits (CUDA C programming guide, compute capabilities 8.0 and 9.0)
    80: dict(regs=65536, smem=164 * 1024, threads=2048, ctas=32),
    90: dict(regs=65536, smem=228 * 1024, threads=2048, ctas=32),
}
SMEM_RESERVED_PER_CTA = 1024
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
_STL_LDL = re.compile(r"\b(STL|LDL)(?:\.(U8|S8|U16|S16|64|128))?\b")
_WIDTH = {None: 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclass
class Resources:
    kernel: str
    group: str
    dtype: str
    sm: int
    config: str  # the constexprs that pick the tiles, and num_warps/num_stages
    tiles: dict  # the tile constexprs and the flags set
    regs: int
    spill_stores: int  # bytes, static (as ptxas -v counts them)
    spill_loads: int
    stack: int  # bytes of stack frame per thread (where ptxas puts spills)
    smem: int  # bytes per CTA
    num_warps: int
    ctas_per_sm: int
    limit: str  # what bounds ctas_per_sm


def _cuobjdump(args, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([knobs.nvidia.cuobjdump.path, *args, f.name], check=True, capture_output=True,
                              text=True).stdout
    finally:
        os.remove(f.name)


def read_cubin(cubin: bytes) -> dict:
    """-> regs, stack (+ local; bytes/thread), static shared, spill_stores / spill_loads (bytes) of its kernel."""
    usage = _cuobjdump(["--dump-resource-usage"], cubin)
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage.split("Function", 1)[1]))
    spills = {"STL": 0, "LDL": 0}
    for op, width in _STL_LDL.findall(_cuobjdump(["-sass"], cubin)):
        spills[op] += _WIDTH[width or None]
    return dict(regs=int(fields["REG"]), stack=int(fields["STACK"]) + int(fields["LOCAL"]),
                static_smem=int(fields["SHARED"]), spill_stores=spills["STL"], spill_loads=spills["LDL"])


def occupancy(sm: int, regs: int, smem: int, num_warps: int) -> tuple[int, str]:
    """(CTAs per SM, the limiting resource) for a CTA of num_warps warps."""
    lim = SM[sm]
    per_warp = -(-max(regs, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    bounds = {
        "regs": lim["regs"] // per_warp // num_warps,
        "smem": lim["smem"] // (smem + SMEM_RESERVED_PER_CTA),
        "threads": lim["threads"] // (32 * num_warps),
        "ctas": lim["ctas"],
    }
    limit = min(bounds, key=bounds.get)
    return bounds[limit], limit


_TILE_KEYS = ("D_PAD", "G_PAD", "H_PAD", "BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_R", "BLOCK", "NS_BLOCK")
# shown when set
_FLAGS = ("SPLIT", "HAS_WINDOW", "HAS_SOFTCAP", "HAS_RES", "GELU_TANH", "STORE_KV", "ATOMIC", "TILE_IN_BLOCK",
          "ROPE_STORE")


def resources(v: kcc.Variant) -> Resources:
    r = read_cubin(v.compiled.asm["cubin"])
    smem = v.compiled.metadata.shared + r["static_smem"]
    ctas, limit = occupancy(v.target.arch, r["regs"], smem, v.num_warps)
    tiles = {k: v.consts[k] for k in _TILE_KEYS if k in v.consts} | {k: True for k in _FLAGS if v.consts.get(k)}
    config = " ".join(k if val is True else f"{k}={val}" for k, val in tiles.items())
    cap = f"r{v.maxnreg}" if v.maxnreg else ""
    return Resources(v.kernel, v.group, v.dtype, v.target.arch,
                     f"{config} w{v.num_warps}s{v.num_stages}{cap}".strip(),
                     tiles, r["regs"], r["spill_stores"], r["spill_loads"], r["stack"], smem, v.num_warps, ctas,
                     limit)


def table(rows: list[Resources]) -> str:
    head = f"{'kernel':<24}{'group':<16}{'dtype':<6}{'config':<44}{'regs':>5}{'spill st/ld':>12}{'smem':>8}" \
           f"{'CTAs/SM':>8}  limit"
    out = []
    for sm in sorted({r.sm for r in rows}):
        out += [f"sm_{sm}", head]
        for r in (r for r in rows if r.sm == sm):
            out.append(f"{r.kernel:<24}{r.group:<16}{r.dtype:<6}{r.config:<44}{r.regs:>5}"
                       f"{f'{r.spill_stores}/{r.spill_loads}':>12}{r.smem:>8}{r.ctas_per_sm:>8}  {r.limit}")
        out.append("")
    return "\n".join(out)


def report(dtypes, groups, sms) -> list[Resources]:
    kcc.targets[:] = [t for t in kcc.TARGETS if t.arch in sms]
    return [resources(v) for v in kcc.launch(dtypes, groups)]


def spilling(rows: list[Resources], groups) -> list[Resources]:
    """The 16-bit variants of `groups` that spill (the serving dtypes; float32 is a test/debug dtype)."""
    return [r for r in rows if r.group in groups and r.dtype in ("bf16", "fp16") and (r.spill_stores or r.stack)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--groups", default=",".join(kcc.GROUPS), help=f"of {', '.join(kcc.GROUPS)}")
    ap.add_argument("--sm", default="80,90")
    ap.add_argument("--json", help="write the rows here, one JSON object a line")
    ap.add_argument("--no-spills", default=",".join(kcc.SERVING),
                    help="exit 1 when a bf16/fp16 variant of these groups spills ('' = report only)")
    a = ap.parse_args(argv)
    t0 = time.time()
    rows = report(a.dtypes.split(","), a.groups.split(","), [int(s) for s in a.sm.split(",")])
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in rows)
    bad = spilling(rows, [g for g in a.no_spills.split(",") if g])
    print(f"{len(rows)} variants in {time.time() - t0:.0f}s; spilling 16-bit variants of {a.no_spills or '-'}: "
          + (", ".join(f"{r.kernel} sm_{r.sm} {r.dtype} [{r.config}]" for r in bad) or "none"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
