"""kernels/ is `loom.kernels`; Python started in the repository's root also finds it as a top-level `kernels`, the name
of the Hugging Face package that transformers (>= 5.25) imports. Found under that name it hands the import on to the
installed package, so transformers, and loom through it, work from the root as from anywhere else."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _installed_kernels() -> Path | None:
    """The installed `kernels` distribution's package file, by its metadata (not by sys.path), or None."""
    try:
        return Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")).resolve()
    except importlib.metadata.PackageNotFoundError:
        return None


def test_python_started_in_the_repository_root_imports_transformers_and_the_installed_kernels():
    # LlamaConfig's module imports transformers' hub_kernels, which imports `kernels` where it is installed
    p = _python("import sys, kernels; from transformers import LlamaConfig; LlamaConfig(); "
                "from loom.kernels import argmax; print(sys.modules['kernels'].__file__)")
    assert p.returncode == 0, p.stderr[-2000:]
    # the installed Hugging Face package where there is one, else this folder (nothing else is called that)
    expected = _installed_kernels() or ROOT / "kernels" / "__init__.py"
    assert Path(p.stdout.strip().splitlines()[-1]).resolve() == expected
