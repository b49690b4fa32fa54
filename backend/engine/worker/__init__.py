"""Running the model: the step's inputs (model_runner, step_buffers), the forward (compiled_forward, CUDA graphs),
start-up (warmup, memory_profile) and what runs on CPU (cpu). vLLM v1's worker."""
