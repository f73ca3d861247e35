"""Helpers for the Batch API tests: batch files, an in-process server (TestClient), and
the server as a user starts it (`tokenmill batch-api` in a subprocess)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

KEYS = {"alice": "k-alice-0123456789", "bob": "k-bob-0123456789"}
CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")


def batch_lines(
    n: int, *, url: str = CHAT, model: str | None = None, max_tokens: int = 4, prefix: str = "r"
) -> list[dict[str, Any]]:
    """`n` request lines with custom_ids prefix0..prefix{n-1}, each its own question."""
    lines = []
    for i in range(n):
        body: dict[str, Any] = {"max_tokens": max_tokens}
        if model is not None:
            body["model"] = model
        if url == "/v1/completions":
            body["prompt"] = f"Count to {i}:"
        elif url == "/v1/embeddings":
            body = {"input": f"text number {i}"}
        else:
            body["messages"] = [{"role": "user", "content": f"Question number {i}?"}]
        lines.append({"custom_id": f"{prefix}{i}", "method": "POST", "url": url, "body": body})
    return lines


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


class ApiServer:
    """The app in this process (FastAPI's TestClient), on a local store."""

    def __init__(self, store: Path, model_dir: Path, **settings: Any) -> None:
        from tokenmill.batch_api.settings import ServerSettings

        self.store = store
        spool = settings.get("spool_dir")
        if spool is not None:
            Path(spool).mkdir(parents=True, exist_ok=True)
            settings["spool_dir"] = str(spool)
        settings.setdefault("job_options", {"max_tokens": 4})
        settings.setdefault("poll_s", 0.1)
        self.settings = ServerSettings(
            store=str(store), models=(str(model_dir),), api_keys=tuple(KEYS.values()), **settings
        )
        self.app = None

    @contextlib.contextmanager
    def client(self, *, start_runner: bool = True) -> Iterator[Any]:
        from fastapi.testclient import TestClient

        from tokenmill.batch_api.app import create_app

        self.app = create_app(self.settings, start_runner=start_runner)
        with TestClient(self.app) as client:
            yield client

    def close(self) -> None:
        pass

    @property
    def db(self):
        return self.app.state.server.db


def upload(client, who: str, data: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    return client.post(
        "/v1/files", headers=auth(who), files={"file": (name, data)}, data={"purpose": purpose}
    )


def create(client, who: str, file_id: str, endpoint: str = CHAT, **extra):
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    return client.post("/v1/batches", headers=auth(who), json=body)


def submit(client, who: str, lines: list[dict], endpoint: str = CHAT, **extra) -> dict:
    """Upload `lines` and create a batch of them; the Batch object."""
    uploaded = upload(client, who, jsonl(lines))
    assert uploaded.status_code == 200, uploaded.text
    created = create(client, who, uploaded.json()["id"], endpoint, **extra)
    assert created.status_code == 200, created.text
    return created.json()


def wait_for(client, who: str, batch_id: str, statuses=FINAL, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth(who)).json()
        if batch["status"] in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch still {batch['status']} after {timeout} s: {batch}")
        time.sleep(0.1)


def content_lines(client, who: str, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content", headers=auth(who))
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def exactly_once(lines: list[dict], expected: list[str]) -> None:
    """Each of `expected` answered by exactly one of `lines`, and nothing else."""
    counts = Counter(line["custom_id"] for line in lines)
    assert sorted(counts) == sorted(expected)
    assert set(counts.values()) == {1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`tokenmill batch-api` as a user starts it, in a subprocess."""

    def __init__(self, store: str, model_dir: Path, *args: str, env: dict | None = None) -> None:
        self.store, self.model_dir, self.args = store, model_dir, list(args)
        self.env = {**os.environ, "TOKENMILL_API_KEYS": ",".join(KEYS.values()), **(env or {})}
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, log: Path, timeout: float = 120.0) -> ServerProcess:
        self.log = log
        command = [
            str(Path(sys.executable).with_name("tokenmill")),
            "batch-api",
            "--store",
            self.store,
            "--port",
            str(self.port),
            "--model",
            str(self.model_dir),
            *self.args,
        ]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=out, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if self.get("/models").status_code == 200:
                    return self
            time.sleep(0.2)
        raise AssertionError(f"the server did not start: {log.read_text()[-3000:]}")

    def get(self, path: str, who: str = "alice") -> httpx.Response:
        return httpx.get(self.base_url + path, headers=auth(who), timeout=30)

    def client(self, who: str = "alice"):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=KEYS[who], max_retries=0, timeout=60)

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a lost node would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
