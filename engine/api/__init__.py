"""The engine's entry points: `LLM` (llm.py) with its pooling methods (pooling_llm.py),
and the loop every call waits in (request_loop.py). `tokenmill.engine` re-exports what
callers use."""
