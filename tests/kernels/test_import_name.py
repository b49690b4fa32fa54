"""kernels/ is `loom.kernels`; Python started in the repository's root also finds it as a top-level `kernels`, the name
of the Hugging Face package that transformers (>= 5.25) imports. Found under that name it hands the import on to the
installed package, so transformers, and loom through it, work from the root as from anywhere else."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHERE = "import importlib.util; s = importlib.util.find_spec('kernels'); print(s.origin if s else '')"


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_python_started_in_the_repository_root_imports_transformers_and_the_installed_kernels(tmp_path):
    elsewhere = _python(WHERE, tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    # an installed Hugging Face `kernels` where there is one, else this folder (nothing else is called that)
    expected = elsewhere.stdout.strip() or str(ROOT / "kernels" / "__init__.py")
    # LlamaConfig's module imports transformers' hub_kernels, which imports `kernels` where it is installed
    p = _python("import sys, kernels; from transformers import LlamaConfig; LlamaConfig(); "
                "from loom.kernels import argmax; print(sys.modules['kernels'].__file__)", ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert Path(p.stdout.strip().splitlines()[-1]).resolve() == Path(expected).resolve()
