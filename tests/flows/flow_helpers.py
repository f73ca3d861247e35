"""Shared by the flow tests: the tiny model's engine settings, rows and job parameters.

(A plain module, not the conftest: test modules import these names directly.)
"""

from __future__ import annotations

# The tiny model's engine: a small KV cache (sizing one from RAM takes seconds) and fp32,
# so every process that loads it computes identical greedy tokens.
ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 16 << 20}}
NUM_ROWS = 16


def prompt_rows(num_rows: int = NUM_ROWS) -> list[dict]:
    """Rows with ids, a few shared prefixes, different lengths, and one null prompt."""
    prefixes = ["The quick brown fox", "Summarise the following text", "What is the capital"]
    rows = []
    for i in range(num_rows):
        prompt = f"{prefixes[i % 3]} {i}: " + "word " * (i % 5)
        rows.append({"id": f"q{i:03d}", "prompt": None if i == 7 else prompt, "topic": i % 3})
    return rows


def job_parameters(input_uri: str, output_uri: str, model: str, **extra) -> dict:
    """Flow parameters for a small job of several shards (a few rows each)."""
    return {
        "input": input_uri,
        "output": output_uri,
        "model": model,
        "id_column": "id",
        "passthrough": ["topic"],
        "max_tokens": 6,
        "shard_tokens": 48,
        "price_input": 0.5,
        "price_cached": 0.25,
        "price_output": 1.5,
        **ENGINE,
        **extra,
    }
