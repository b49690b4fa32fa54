"""Turning logits into tokens: the batch sampler and its filters and counter-based RNG, the persistent sampling
state, logits processors and structured outputs. vLLM v1's sample."""
