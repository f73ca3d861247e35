"""Measurements of the Batch API server (not tests: run by hand, report the figures).

    python tests/batch_api/measure.py overhead --lines 5000 --pairs 3
    python tests/batch_api/measure.py upload-memory --megabytes 200

overhead: the same OpenAI batch file through `tokenmill run` and through the server
(upload, create, poll, download with the `openai` client), alternated pair by pair on
the tiny model, with the load average beside each pair (the machine may be shared).
Warm: one server, started once and warmed by a one-line batch, as a server runs. Cold:
a server started for the batch, its start and engine load counted as `tokenmill run`
counts its own.

upload-memory: the server's RSS (from /proc) sampled every 20 ms during a streamed
upload of the given size, against its RSS when idle; then an upload 1.25 times the
limit, refused with 413 and nothing on the store.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from api_helpers import KEYS, ServerProcess, batch_lines, jsonl  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

OPTIONS = {"max_tokens": 16}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_cli(model: Path, data: Path, out: Path) -> float:
    command = [str(Path(sys.executable).with_name("tokenmill")), "run", str(data), str(out)]
    command += ["--model", str(model), "--format", "openai-batch"]
    command += ["--output-format", "openai-batch", "--max-tokens", str(OPTIONS["max_tokens"])]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def run_api(server: ServerProcess, data: Path) -> float:
    client = server.client()
    started = time.perf_counter()
    with open(data, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while (batch := client.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        time.sleep(0.1)
    assert batch.status == "completed", batch
    output = client.files.content(batch.output_file_id).content
    elapsed = time.perf_counter() - started
    assert output.count(b"\n") == batch.request_counts.completed
    return elapsed


def overhead(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="batch-api-overhead-"))
    model = build_tiny_model(work / "model")
    data = work / "requests.jsonl"
    data.write_bytes(jsonl(batch_lines(args.lines, max_tokens=OPTIONS["max_tokens"])))

    def new_server(name: str) -> ServerProcess:
        option = f"max_tokens={OPTIONS['max_tokens']}"
        return ServerProcess(str(work / name), model, "--option", option)

    print(f"{args.lines} lines, tiny model, max_tokens {OPTIONS['max_tokens']}")
    print("pair  tokenmill run (s)  batch API warm (s)  ratio  batch API cold (s)  ratio  load")
    server = new_server("store")
    server.start(work / "server.log")
    try:
        warm = work / "warm.jsonl"
        warm.write_bytes(jsonl(batch_lines(1)))
        run_api(server, warm)
        for pair in range(args.pairs):
            cli = run_cli(model, data, work / f"run-{pair}")
            api = run_api(server, data)
            # Cold: a server started for this batch alone, its start and engine load
            # counted, as `tokenmill run` counts its own.
            started = time.perf_counter()
            cold = new_server(f"cold-{pair}")
            cold.start(work / f"cold-{pair}.log")
            try:
                run_api(cold, data)
            finally:
                cold.stop()
            cold_s = time.perf_counter() - started
            print(
                f"{pair + 1:>4}  {cli:>17.2f}  {api:>18.2f}  {api / cli:>5.3f}  {cold_s:>18.2f}  "
                f"{cold_s / cli:>5.3f}  {load()}"
            )
    finally:
        server.stop()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def upload_memory(args) -> None:
    import httpx

    work = Path(tempfile.mkdtemp(prefix="batch-api-upload-"))
    model = build_tiny_model(work / "model")
    server = ServerProcess(str(work / "store"), model)
    server.start(work / "server.log")
    try:
        pid = server.process.pid
        time.sleep(2)
        idle = rss_kb(pid)
        line = json.dumps(batch_lines(1)[0]).encode() + b"\n"
        limit = 200 * 1024 * 1024

        def body(total: int):
            boundary = b"measureboundary"
            yield (
                b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
                b"batch\r\n--" + boundary + b"\r\nContent-Disposition: form-data; "
                b'name="file"; filename="big.jsonl"\r\n\r\n'
            )
            chunk = line * (1024 * 1024 // len(line))
            sent = 0
            while sent + len(chunk) <= total:
                yield chunk
                sent += len(chunk)
            yield b"\r\n--" + boundary + b"--\r\n"

        def upload(total: int) -> tuple[httpx.Response, int]:
            peak = [idle]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_kb(pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                response = httpx.post(
                    server.base_url + "/files",
                    content=body(total),
                    headers={
                        "Authorization": f"Bearer {KEYS['alice']}",
                        "Content-Type": "multipart/form-data; boundary=measureboundary",
                    },
                    timeout=600,
                )
            finally:
                done.set()
                sampler.join()
            return response, peak[0]

        size = min(args.megabytes * 1024 * 1024, limit - 2 * 1024 * 1024)
        response, peak = upload(size)
        assert response.status_code == 200, response.text
        print(
            f"idle RSS {idle / 1024:.1f} MB; during a {size / 2**20:.0f} MiB upload: peak "
            f"{peak / 1024:.1f} MB (+{(peak - idle) / 1024:.1f} MB); stored "
            f"{response.json()['bytes']:,} bytes"
        )
        stored = sorted(os.listdir(work / "store" / "files"))
        response, peak = upload(int(limit * 1.25))
        print(
            f"a {limit * 1.25 / 2**20:.0f} MiB upload: {response.status_code} "
            f"{response.json()['error']['code']}; peak {peak / 1024:.1f} MB "
            f"(+{(peak - idle) / 1024:.1f} MB); files on the store unchanged: "
            f"{sorted(os.listdir(work / 'store' / 'files')) == stored}; load {load()}"
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--lines", type=int, default=5000)
    o.add_argument("--pairs", type=int, default=3)
    m = sub.add_parser("upload-memory")
    m.add_argument("--megabytes", type=int, default=200)
    args = parser.parse_args()
    (overhead if args.what == "overhead" else upload_memory)(args)


if __name__ == "__main__":
    main()
