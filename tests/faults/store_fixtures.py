"""Fixtures and helpers for the object-store, worker-death and hostile-input fault tests.

Test modules import the fixtures they use by name (`from store_fixtures import s3`);
the plain helpers (`upload_rows`, `count_rows`...) are also what `scenarios_b.py`
runs outside pytest.
"""

from __future__ import annotations

import io
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))  # tests/ holds shared helpers; it is not a package

from s3_server import S3Endpoint, moto_s3  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

BUCKET = "tokenmill-faults-test"
NUM_ROWS = 24
# The engine of the tiny model: small KV cache (sizing one from RAM takes seconds), fp32.
ENGINE = {"kv_cache_memory": 8 << 20}
# A short job of several shards, so a fault can hit one shard while others complete.
JOB_OPTIONS = {"max_tokens": 3, "shard_tokens": 60, "id_column": "id"}
# Fast failure for tests: 3 attempts per request, 1 s timeouts. Users set the same way.
FAST_STORE = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 3}}}
FAST_TIMEOUTS = {"read_timeout": 1.0, "connect_timeout": 1.0}


def prompt_rows(num_rows: int = NUM_ROWS) -> list[dict[str, Any]]:
    """Rows with ids and prompts of a few lengths."""
    return [{"id": f"r{i:04d}", "prompt": f"Numbers: {i} " * (1 + i % 3)} for i in range(num_rows)]


def upload_rows(endpoint: S3Endpoint, key: str, rows: list[dict[str, Any]]) -> str:
    """Writes `rows` as a Parquet object straight to moto (no proxy); returns its URL."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    s3fs.S3FileSystem(**endpoint.storage_options).pipe(endpoint.url(key), buf.getvalue())
    return endpoint.url(key)


def through(endpoint: S3Endpoint, proxy_url: str, *, timeouts: bool = False) -> dict[str, Any]:
    """Storage options that reach the bucket through the proxy, with the fast policy."""
    config = dict(FAST_STORE["config_kwargs"])
    if timeouts:
        config.update(FAST_TIMEOUTS)
    return {
        **endpoint.storage_options,
        "endpoint_url": proxy_url,
        "config_kwargs": config,
    }


def lost_and_duplicated(ids: list[str], expected: list[str]) -> tuple[int, int]:
    """(rows lost, rows duplicated) of a job's result ids against its input ids."""
    counts = Counter(ids)
    lost = sum(1 for i in expected if counts[i] == 0)
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    return lost, duplicated


def bucket_objects(endpoint: S3Endpoint, prefix: str) -> list[str]:
    """Every object key under `prefix`, read straight from moto (hidden ones included)."""
    import s3fs

    fs = s3fs.S3FileSystem(**endpoint.storage_options, skip_instance_cache=True)
    return sorted(fs.find(f"{endpoint.bucket}/{prefix}"))


# An embedding job's options: a short job of several shards, as JOB_OPTIONS.
EMBED_JOB_OPTIONS = {"task": "embed", "shard_tokens": 60, "id_column": "id"}


def load_tiny_llm(directory: Path, task: str = "generate"):
    """The tiny random Llama model (or for task "embed" a tiny BERT embedding model),
    built in `directory` and loaded on CPU in fp32."""
    from tokenmill.engine.api.llm import LLM

    if task == "embed":
        from fault_jobs import build_embedding_model

        model_dir = build_embedding_model(directory / "encoder")
        return LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=16)
    model_dir = build_tiny_model(directory / "tiny")
    return LLM(str(model_dir), device="cpu", dtype="float32", **ENGINE)


@pytest.fixture(scope="session")
def s3() -> S3Endpoint:
    """moto's S3 server on loopback with this suite's own bucket."""
    with moto_s3(bucket=BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    return load_tiny_llm(tmp_path_factory.mktemp("faults-b-model"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # weights_hash remembers file digests in the tokenmill cache; keep tests out of ~/.cache.
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tm-cache"))


def _flows_conftest():
    """tests/flows/conftest.py loaded as a plain module, to borrow one fixture from it."""
    import importlib.util

    if str(TESTS_DIR / "flows") not in sys.path:
        sys.path.append(str(TESTS_DIR / "flows"))  # it imports flow_helpers from there
    spec = importlib.util.spec_from_file_location(
        "flows_conftest_for_faults", TESTS_DIR / "flows" / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A real Prefect server (PREFECT_API_URL's, or one started for the session): the very
# fixture the flow tests use, so both suites start and stop servers the same way.
prefect_api = _flows_conftest().prefect_api
