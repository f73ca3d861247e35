"""Runs the workload through llama.cpp's own server, the way its users run batches:
`llama-server` with parallel slots and continuous batching, every request sent at once.

The server is the C++ binary built from llama.cpp's sources (for example those the
llama-cpp-python sdist carries: `cmake -B build && cmake --build build --target
llama-server`); pass it with `--llama-server PATH` or `TOKENMILL_LLAMA_SERVER`. It runs
on a loopback port for this run only and is stopped afterwards. Each request is one
streamed `/completion` call over the workload's token ids, greedy, EOS ignored; the
first streamed chunk times the first token, and the server's own counters (`timings`)
say how many prompt tokens it computed and how many it took from its prompt cache.
A sequential workload runs on one slot, each request sent when the previous one ended.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tokenmill.bench.result import RunResult, Stopwatch, tpot
from tokenmill.bench.run_llamacpp import source_gguf
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload, warmup_prompts

_HOST = "127.0.0.1"
_START_TIMEOUT_S = 120.0


def run_llamacpp_server(job: Job, workload: Workload) -> RunResult:
    """Start llama-server on the GGUF, warm it up, then time all requests sent at once."""
    options = job.system.options
    binary = options.get("server") or os.environ.get("TOKENMILL_LLAMA_SERVER")
    if not binary or not Path(binary).is_file():
        raise FileNotFoundError("llama-server binary not found: pass --llama-server PATH")
    gguf = options.get("gguf") or source_gguf(job.model_dir)
    # A sequential workload is one user's requests in turn: one slot serves them.
    slots = (
        1 if workload.sequential else int(options.get("parallel") or min(64, workload.num_requests))
    )
    longest = max(len(p) + n for p, n in zip(workload.prompt_ids, workload.output_lens))
    threads = job.threads or os.cpu_count() or 1
    port = _free_port()
    command = [
        str(binary), "-m", str(gguf), "--host", _HOST, "--port", str(port),
        "-np", str(slots), "-c", str(slots * (longest + 16)), "--cont-batching",
        "-t", str(threads), "-tb", str(threads), "--no-webui", "--log-disable",
        *options.get("args", []),
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log, _Server(command, port, log) as server:
        for prompt in warmup_prompts(workload):
            server.complete(prompt, 4)
        results: list[dict | None] = [None] * workload.num_requests
        submitted = [0.0] * workload.num_requests

        def send(i: int) -> None:
            submitted[i] = time.perf_counter()
            results[i] = server.complete(workload.prompt_ids[i], workload.output_lens[i])

        threads_list = [
            threading.Thread(target=send, args=(i,)) for i in range(workload.num_requests)
        ]
        cpu_before = server.cpu_seconds()
        with Stopwatch() as clock:
            if workload.sequential:
                for i in range(workload.num_requests):
                    send(i)
            else:
                for thread in threads_list:
                    thread.start()
                for thread in threads_list:
                    thread.join()
        server_cpu_s = server.cpu_seconds() - cpu_before
        server_peak_rss = server.peak_rss_bytes()
    failed = [i for i, r in enumerate(results) if r is None or "error" in r]
    if failed:
        raise RuntimeError(
            f"{len(failed)} llama-server requests failed, first: {results[failed[0]]}"
        )
    cached = [r["cached"] for r in results]
    computed = [len(p) - c for p, c in zip(workload.prompt_ids, cached)]
    return RunResult(
        system=job.system.label,
        wall_s=clock.wall_s,
        num_prompt_tokens=workload.num_prompt_tokens,
        num_computed_prompt_tokens=sum(computed),
        num_cached_prompt_tokens=sum(cached),
        num_generated_tokens=sum(len(r["tokens"]) for r in results),
        computed_prompt=computed,
        cached_prompt=cached,
        generated=[len(r["tokens"]) for r in results],
        # From each request's own submission when they go one at a time.
        ttft_s=[
            r["first"] - (t if workload.sequential else clock.start)
            for r, t in zip(results, submitted)
        ],
        tpot_s=[tpot(r["first"], r["finish"], len(r["tokens"])) for r in results],
        # The server is another process: its CPU time and memory are what count.
        cpu_s=server_cpu_s,
        peak_rss_bytes=server_peak_rss,
        extra={
            "gguf": str(gguf),
            "format": options.get("format"),
            "threads": threads,
            "parallel": slots,
            "binary": str(binary),
            "args": options.get("args", []),
        },
        output_ids=[r["tokens"] for r in results],
    )


class _Server:
    """A llama-server process on a loopback port; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, command: list[str], port: int, log) -> None:
        self.command, self.port, self.log = command, port, log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> _Server:
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                tail = self.log.read()[-500:].decode(errors="replace")
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {tail}")
            if self._healthy():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {_START_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def cpu_seconds(self) -> float:
        """The server's user + system CPU time so far (/proc/PID/stat)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_bytes(self) -> int:
        """The server's peak resident memory (VmHWM)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def _healthy(self) -> bool:
        try:
            conn = http.client.HTTPConnection(_HOST, self.port, timeout=2)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def complete(self, prompt: list[int], num_tokens: int) -> dict:
        """One greedy streamed completion: {"tokens", "first", "finish", "cached"}."""
        body = {
            "prompt": prompt,
            "n_predict": num_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": True,
            "stream": True,
            "return_tokens": True,
        }
        conn = http.client.HTTPConnection(_HOST, self.port, timeout=3600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {response.read()[:200]!r}"}
        tokens: list[int] = []
        first = None
        final: dict = {}
        for line in response:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("tokens"):
                if first is None:
                    first = time.perf_counter()
                tokens.extend(chunk["tokens"])
            if chunk.get("stop"):
                final = chunk
                break
        finish = time.perf_counter()
        conn.close()
        timings = final.get("timings", {})
        cached = int(timings.get("cache_n", len(prompt) - timings.get("prompt_n", len(prompt))))
        return {"tokens": tokens, "first": first or finish, "finish": finish, "cached": cached}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]
