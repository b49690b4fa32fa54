"""Shared helpers for the benchmark scripts (scripts/bench_*.py).

Import this module before torch: it applies the engine's CPU tuning (MKL_ENABLE_INSTRUCTIONS=AVX2 on AMD)
before torch loads MKL, so every library in the process, the HF peers included, gets the same tuning, which
keeps the comparison fair.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from loom.engine.worker.cpu import tune_mkl_for_amd

REPO_ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
tune_mkl_for_amd()

RESULTS_DIR = REPO_ROOT / "results"

# Ordinary English sentences, the prompts of the published protocol: varied topics and lengths, no chat
# template, no special tokens. A run with more prompts than this cycles through the list.
PROMPTS: list[str] = [
    "The weather was cold this morning, so I put on my warmest coat before going out.",
    "My grandmother grows tomatoes, beans and peppers in the small garden behind her house.",
    "The train to the city leaves every half hour from the platform next to the bakery.",
    "She read the whole novel in one weekend because she could not stop turning the pages.",
    "Our team finally finished the project after three months of careful planning and testing.",
    "The children built a sandcastle near the water and watched the waves wash it away.",
    "He forgot his umbrella at the office and got completely soaked on the way home.",
    "The museum has a new exhibition about the history of ships and ocean exploration.",
    "Every Sunday we cook a big breakfast together and talk about the week ahead.",
    "The old bridge across the river was repaired last summer and now looks brand new.",
    "I am learning to play the guitar, and my fingers hurt after every practice.",
    "The library stays open late on Thursdays for students who need a quiet place to study.",
    "A small dog followed us all the way from the park to the front door of our building.",
    "The restaurant on the corner serves the best soup I have ever tasted.",
    "Scientists believe that regular exercise improves both memory and mood.",
    "The meeting was moved to Friday because half of the team was travelling.",
    "My brother wants to become a pilot and spends hours reading about airplanes.",
    "The farmers were worried that the dry summer would ruin this year's harvest.",
    "We watched the sunset from the top of the hill and then walked back in the dark.",
    "The new phone has a better camera, but the battery does not last as long.",
    "Please remember to water the plants while I am away on holiday next week.",
    "The teacher explained the problem again, and this time everyone understood it.",
    "Traffic was so heavy this evening that the bus arrived forty minutes late.",
    "She painted the kitchen a bright yellow colour to make the room feel warmer.",
    "The city plans to plant a thousand trees along its main streets next spring.",
    "After dinner, my father likes to take a long walk around the neighbourhood.",
    "The hotel room was small but clean, and the view of the mountains was wonderful.",
    "Our neighbours are having a party tonight, so it will probably be noisy.",
    "The doctor told him to drink more water and to get at least eight hours of sleep.",
    "The concert was cancelled at the last minute because of a storm.",
    "Learning a new language takes patience, practice and a lot of mistakes.",
    "The cat sleeps in the sunniest spot of the living room every afternoon.",
    "He wrote a long letter to his old friend, who now lives on the other side of the world.",
    "The shop around the corner sells fresh bread, cheese and homemade jam.",
    "Most people in the village know each other by name and greet each other on the street.",
    "The football match ended in a draw after an exciting second half.",
    "My sister bought a second-hand bicycle and now rides it to work every day.",
    "The instructions were confusing, so it took us two hours to assemble the bookshelf.",
    "In autumn the leaves in the park turn red, orange and gold.",
    "The company opened a new office downtown and hired twenty more people.",
    "I always make a list before going to the supermarket, but I still forget something.",
    "The students planted a vegetable garden behind the school as a science project.",
    "It snowed all night, and in the morning the whole town was covered in white.",
    "The baker wakes up at four o'clock every morning to prepare the bread.",
    "We are planning a trip to the coast to visit some friends we have not seen in years.",
    "The film was much longer than I expected, but the ending was worth the wait.",
    "Good friends are the people who help you move house without complaining.",
    "The lake near our cabin is perfect for swimming on hot summer days.",
    "He spent the afternoon fixing the old radio he found in his grandfather's attic.",
    "The price of coffee has gone up again, so I have started drinking tea.",
    "The nurse checked on the patients every hour during the long night shift.",
    "Our flight was delayed, so we had dinner at the airport and played cards.",
    "The mountain trail is steep in places, but the view from the top is breathtaking.",
    "She keeps a diary and writes a few lines in it every evening before bed.",
    "The town hall clock has been broken for years, and nobody seems to mind.",
    "Bees are important for farming because they pollinate many of the crops we eat.",
    "The children were excited about the first day of the summer holidays.",
    "I found an interesting book about the history of maps at the flea market.",
    "The carpenter measured the window twice before cutting the new frame.",
    "My favourite season is spring, when the days get longer and the flowers bloom.",
    "The new road will make the drive to the next town about fifteen minutes shorter.",
    "Every year the village holds a festival with music, food and dancing in the square.",
    "The little boy asked why the sky is blue and why the grass is green.",
    "After a long day at work, there is nothing better than a hot bath and a good book.",
]


def prompts(n: int) -> list[str]:
    """n prompts, cycling through PROMPTS."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def default_model_dir() -> str:
    from harness.default_model import ensure_default_model

    return str(ensure_default_model())


# ---- statistics ------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan for no values."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def summarize(values: Iterable[float]) -> dict:
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan"),
                "min": float("nan"), "max": float("nan")}
    return {"n": len(vals), "mean": sum(vals) / len(vals), "p50": percentile(vals, 50), "p90": percentile(vals, 90),
            "p99": percentile(vals, 99), "min": min(vals), "max": max(vals)}


def ratio(a: float | None, b: float | None) -> float:
    """a / b, nan when either is missing or b is 0."""
    if a is None or b is None or not b or a != a or b != b:
        return float("nan")
    return a / b


# ---- output --------------------------------------------------------------------------------------

_T_START = time.perf_counter()


def progress(msg: str) -> None:
    """A progress line on stderr with the seconds since the script started."""
    print(f"[{time.perf_counter() - _T_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence], digits: int = 2) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(c, digits) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except Exception:
        commit, dirty = "", False
    try:
        import transformers
        tf_version = transformers.__version__
    except Exception:
        tf_version = None
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": tf_version,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": commit + ("+dirty" if dirty else ""),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    info["cpu_16bit_units"] = cpu_16bit_units()
    return info


# CPU flags of native 16-bit and int8 dot-product units (what a bfloat16 GEMM can dispatch to)
CPU_16BIT_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx_vnni", "avx512_vnni")


def cpu_16bit_units() -> list[str]:
    """Which of CPU_16BIT_FLAGS this CPU has (/proc/cpuinfo), for the reports (which units each system could use)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return []
    return [f for f in CPU_16BIT_FLAGS if f in flags]


def out_dir(path: str | None = None) -> Path:
    d = Path(path) if path else RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d


def stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def save_json(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=_json_default)
    progress(f"raw results -> {path}")
    return path


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        progress("matplotlib is not installed: no plot (pip install matplotlib)")
        return False


def new_figure(nrows: int = 1, ncols: int = 1, size=(11, 4.5)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False)
    return plt, fig, axes


def save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot -> {path}")
    return path


def save_results(data: dict, prefix: str, args, plot) -> None:
    """results/<prefix>-<stamp>[-tag].json and, unless --no-plot, the .png drawn by plot(data, path)."""
    out = out_dir(args.out_dir)
    name = f"{prefix}-{stamp()}{'-' + args.tag if args.tag else ''}"
    save_json(data, out / f"{name}.json")
    if not args.no_plot:
        try:
            plot(data, out / f"{name}.png")
        except Exception as e:  # a plot must never cost the measured numbers
            progress(f"plot failed: {type(e).__name__}: {e}")
