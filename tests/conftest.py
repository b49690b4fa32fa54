"""Shared test set-up: float32, deterministic, and the CPU tuning applied before torch loads."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import backend  # noqa: E402,F401  (sets MKL tuning before torch is imported)
