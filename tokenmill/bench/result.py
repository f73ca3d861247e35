"""What one timed run of one system hands back to the harness (as JSON, across processes)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    """One system's timed pass over a workload, measured inside its own process.

    Per-request lists are in workload order. Times are seconds from the moment the
    whole workload was handed to the system (offline batch: every request arrives at 0).
    """

    system: str  # the system's label, e.g. "tokenmill-bf16"
    wall_s: float  # the timed generate call(s), model loading and warm-up excluded
    num_prompt_tokens: int
    num_computed_prompt_tokens: int  # through the model: cache misses, recomputes, padding
    num_cached_prompt_tokens: int  # served from a prefix cache
    num_generated_tokens: int
    # Per request: prompt tokens computed and served from cache (for the FLOP count).
    computed_prompt: list[int]
    cached_prompt: list[int]
    generated: list[int]
    ttft_s: list[float]  # time to first token
    tpot_s: list[float]  # (finish - first token) / (generated - 1); 0 for one-token outputs
    peak_rss_bytes: int = 0
    cpu_s: float = 0.0  # user + system CPU time of the process during the timed run
    load_avg_1m: float = 0.0  # the machine's load average when the timed run ended
    extra: dict = field(default_factory=dict)  # system-specific facts (batch size, notes)
    output_ids: list[list[int]] | None = None  # greedy outputs, to compare systems

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, path: str | Path) -> RunResult:
        return cls(**json.loads(Path(path).read_text()))


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far.

    On Linux, the kernel's high-water mark of this process's own memory (VmHWM): a child
    started by a large parent inherits the parent's ru_maxrss across fork and exec, so a
    benchmark child would report the harness's memory as its own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Stopwatch:
    """Wall and CPU time of a block: `with Stopwatch() as sw: ...; sw.wall_s, sw.cpu_s`.

    CPU time next to wall time shows contention: on a quiet machine a 2-thread run uses
    close to 2 CPU-seconds per second; another job on the same cores lowers that.
    """

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self._cpu_start = cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.start
        self.cpu_s = cpu_seconds() - self._cpu_start


def load_avg_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def tpot(first_token_s: float, finish_s: float, num_generated: int) -> float:
    """Mean time per output token after the first."""
    return (finish_s - first_token_s) / (num_generated - 1) if num_generated > 1 else 0.0
