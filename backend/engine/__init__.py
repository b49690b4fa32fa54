"""The engine core: requests in, one step at a time (schedule -> run -> sample), token ids out; and the
offline API over it (`loom.engine.llm.LLM`)."""
