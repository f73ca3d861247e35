"""A real S3-protocol server on loopback (moto), for any test suite that needs S3.

Use from a conftest (this directory is not a package; put it on `sys.path` first)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # .../tests
    from s3_server import moto_s3

    @pytest.fixture(scope="session")
    def s3():
        with moto_s3() as endpoint:
            yield endpoint

then `open_source(endpoint.url("in/data.parquet"), storage_options=endpoint.storage_options)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Endpoint:
    """Where the test server listens and how to reach its bucket."""

    endpoint_url: str
    bucket: str
    # fsspec/s3fs options, as `storage_options=` everywhere in tokenmill.
    storage_options: dict[str, Any] = field(repr=False)

    def url(self, key: str = "") -> str:
        """`s3://<bucket>/<key>`."""
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    @property
    def polars_storage_options(self) -> dict[str, str]:
        """The same endpoint in the spelling polars' object_store expects."""
        return {
            "aws_endpoint_url": self.endpoint_url,
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
            "aws_region": REGION,
            "aws_allow_http": "true",
        }


@contextlib.contextmanager
def moto_s3(bucket: str = "tokenmill-test") -> Iterator[S3Endpoint]:
    """Starts moto's threaded HTTP server on 127.0.0.1 (a free port) with one bucket.

    The AWS_* variables are set for the duration (botocore reads the region from
    them; `client_kwargs` region settings break bucket creation) and restored after.
    """
    # Imported here: moto takes seconds to import and most test modules never need it.
    import s3fs
    from moto.server import ThreadedMotoServer

    # werkzeug logs one line per request; keep test output readable.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint_url = f"http://127.0.0.1:{server._server.server_port}"
        options = {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": endpoint_url}
        # moto keeps its buckets per process, shared by every server started in it: a
        # bucket another suite's server made is already there, which is fine.
        s3fs.S3FileSystem(**options).makedirs(bucket, exist_ok=True)
        yield S3Endpoint(endpoint_url=endpoint_url, bucket=bucket, storage_options=options)
    finally:
        server.stop()
        # Cached filesystem instances point at the dead port; drop them.
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
