"""The serving layer: Triton request parsing, the engine's thread-safe front, response streaming, metrics.
Nothing here imports triton_python_backend_utils; `loom.model` hands it in."""
