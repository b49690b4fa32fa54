"""Tensor parallelism: the rank group and its collectives (parallel_state), the step's inputs from rank 0 to the
other ranks (step_broadcast), the worker processes' loop (worker) and their lifecycle (ranks)."""
