"""Scheduling: which sequences run each step (scheduler), their KV blocks (block_manager), the sequences
themselves, and what a finished step hands back (output_processor). vLLM v1's core."""
