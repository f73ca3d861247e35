"""`ServerSettings`: everything `tokenmill batch-api` is started with, checked at start.

The job options every batch runs with (`job_options`) are the job definition's
(`pipelines/options.py`), checked by it; the server sets the few that make a job a batch
(formats, where it reads and writes, its ledger) itself, and refuses them by name here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill.connectors.fs import redact_url
from tokenmill.pipelines.option_types import JOB
from tokenmill.pipelines.options import check_names
from tokenmill.pipelines.spec import JobSpec

LOOPBACK_NAMES = ("localhost",)
# OpenAI's limits, the defaults here.
MAX_UPLOAD_BYTES = 200 * 1024 * 1024
MAX_LINES = 50_000
MAX_EMBEDDING_INPUTS = 50_000
RETENTION_S = 30 * 24 * 3600
COMPLETION_WINDOW = "24h"  # the one value OpenAI's API (and its client's types) takes

# Job options the server decides for every batch: a batch is an OpenAI batch file run
# into its own directory of the store, its lines choose their own prompts and adapters.
SERVER_OPTIONS = frozenset(
    {
        "task",
        "format",
        "output_format",
        "prompt_column",
        "messages_column",
        "template",
        "id_column",
        "passthrough",
        "lora_column",
        "query_column",
        "json_schema_column",
        "limit",
        "dry_run",
        "resume",
        "ledger_dataset",
        "storage_options",
        "model",
        "lora",
    }
)


@dataclass
class ServerSettings:
    """How the server runs.

    Args:
        store: where files and each batch's work live: a local directory or any fsspec
            URL (s3://bucket/prefix).
        models: the served models (directory, .gguf, alias or Hub id); the first answers
            lines that name none.
        lora: LoRA adapters of the first model, name -> path or Hub id.
        database_url: SQLAlchemy URL of the state database (default: SQLite in a local
            store; an object store needs one).
        api_keys: the bearer tokens accepted; each key sees only its own objects.
        no_auth: serve without keys (loopback hosts only).
        host: the address to listen on (checked against no_auth).
        runner: "local" (in-process, one warm engine per model) or "prefect".
        prefect_deployment: with runner prefect, the deployment of the batch-inference
            flow whose runs do the work (batch-inference/NAME).
        storage_options: the store's fsspec options (credentials stay out of logs).
        job_options: the job options every batch runs with (`pipelines/options.py`).
        max_upload_bytes: the largest upload accepted.
        max_lines: the most request lines in a batch.
        max_embedding_inputs: the most embedding inputs in an /v1/embeddings batch.
        max_concurrent_batches: batches in progress at once (of different keys: a key's
            batches run one after another, in creation order).
        max_queued_lines_per_key: the request lines a key may have waiting or running.
        completion_window_s: the time a batch has from its creation (OpenAI's 24 hours;
            longer for slow hardware), after which it expires keeping what finished.
        retention_s: how long files and a finished batch's work stay on the store.
        spool_dir: where uploads are spooled while they are checked (default: the
            system's temporary directory).
        poll_s: how often the runner looks for work it was not told of.
    """

    store: str
    models: tuple[str, ...] = ()
    lora: dict[str, str] | None = None
    database_url: str | None = None
    api_keys: tuple[str, ...] = ()
    no_auth: bool = False
    host: str = "127.0.0.1"
    runner: str = "local"
    prefect_deployment: str = "batch-inference/batch-api"
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    job_options: dict[str, Any] = field(default_factory=dict)
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_lines: int = MAX_LINES
    max_embedding_inputs: int = MAX_EMBEDDING_INPUTS
    max_concurrent_batches: int = 4
    max_queued_lines_per_key: int = 1_000_000
    completion_window_s: float = 24 * 3600
    retention_s: float = RETENTION_S
    spool_dir: str | None = None
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        self.store = self.store.rstrip("/") or "/"
        if "://" not in self.store:
            self.store = os.path.abspath(self.store)
        self.models = tuple(self.models) or (None,)
        if self.runner not in ("local", "prefect"):
            raise ValueError(f"runner must be local or prefect, got {self.runner!r}")
        if not self.api_keys and not self.no_auth:
            raise ValueError(
                "no API keys: set TOKENMILL_API_KEYS or --api-keys-file (or --no-auth, "
                "on a loopback host only)"
            )
        if self.no_auth and not is_loopback(self.host):
            raise ValueError(
                f"--no-auth serves anyone who can reach the server: only on a loopback host "
                f"(127.0.0.1, ::1, localhost), not {self.host!r}"
            )
        for name, value in (
            ("max_upload_bytes", self.max_upload_bytes),
            ("max_lines", self.max_lines),
            ("max_embedding_inputs", self.max_embedding_inputs),
            ("max_concurrent_batches", self.max_concurrent_batches),
            ("max_queued_lines_per_key", self.max_queued_lines_per_key),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.completion_window_s <= 0 or self.retention_s <= 0:
            raise ValueError("the completion window and the retention must be positive")
        given = sorted(SERVER_OPTIONS & set(self.job_options))
        if given:
            raise ValueError(
                f"{', '.join(given)}: set by the server for every batch (models with --model, "
                "adapters with --lora), not a job option it takes"
            )
        if self.job_options.get("image_root"):
            raise ValueError(
                "image_root: a batch line never makes the server read its own disk; lines "
                "carry images as data: URLs, or from URL schemes allowed by "
                "allow_url_schemes"
            )
        # Checked now, as the job definition checks any job's options, not at a batch.
        check_names(self.job_options, surface=JOB)
        JobSpec("batch.jsonl", "out", format="openai-batch", **self.job_options)
        if (
            self.database_url is None
            and "://" in self.store
            and not self.store.startswith("file://")
        ):
            raise ValueError(
                f"the store {redact_url(self.store)} is not local disk, and SQLite cannot live "
                "on an object store: give --database-url (sqlite:///PATH on local disk, or "
                "postgresql://...)"
            )

    @property
    def database(self) -> str:
        """The database URL: the given one, or SQLite in the (local) store."""
        if self.database_url is not None:
            return self.database_url
        root = self.store.removeprefix("file://")
        return f"sqlite:///{os.path.join(root, 'batch-api.sqlite3')}"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def owner_of(api_key: str) -> str:
    """The owner recorded for a key's objects: a digest, so the database holds no key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


ANONYMOUS = "anonymous"  # the owner of every object with --no-auth


def read_api_keys(text: str) -> tuple[str, ...]:
    """Keys from TOKENMILL_API_KEYS (comma or whitespace separated) or a keys file (one a
    line; `#` starts a comment)."""
    keys = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        keys += [k for k in re.split(r"[,\s]+", line) if k]
    return tuple(dict.fromkeys(keys))


def parse_duration(text: str) -> float:
    """ "24h", "90m", "30s", "2d" as seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if not match:
        raise ValueError(f"a duration is a number and a unit (s, m, h, d), e.g. 72h; got {text!r}")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
