"""An image job at scale: `tokenmill run` over N rows of image bytes, its peak RSS sampled,
optionally SIGKILLed part-way and resumed, then every id checked to be answered once.

    python benchmarks/images_job_scale.py [--rows 10000] [--model DIR | --tiny qwen2.5-vl]
                                          [--kill-after-parts K] [--max-tokens 2] [--keep DIR]

The input is a Parquet file of `--rows` rows (id, prompt, image: encoded bytes), written
in row groups of 500 so this script never holds it whole; the images are drawn with
Pillow from a seed (tokenmill/bench/image_workload.py: longer side 64-640 px, seven
aspect ratios, JPEG, PNG and WebP). The job runs as a user runs it, in a child process
(`tokenmill run --raw --image-column image`, greedy, `--max-tokens` tokens a row,
shards of `--shard-tokens` tokens). Its memory is read from /proc/PID/status every 50 ms
- VmHWM, the kernel's high-water mark of the process's resident set, so a peak between
two samples is not missed - for the job and any process it starts. With
`--kill-after-parts K` the first run is SIGKILLed once K shards' results are committed,
and the same command is run again (resume); the results are then read back and every
input id must appear exactly once.

Without `--model`, a tiny random VLM is built (`--tiny`, tokenmill/bench/tiny_vlm.py):
the figures are the pipeline's and the decode pool's, not a real tower's.
Prints one JSON object: rows, errors, shards, each run's wall seconds and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROW_GROUP = 500
LONG_SIDE = (64, 640)


def write_input(path: Path, num_rows: int, seed: int) -> int:
    """The Parquet input; returns its size in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.bench.image_workload import draw_image

    rng = random.Random(f"{seed}:images")
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("image", pa.binary())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, num_rows, ROW_GROUP):
            rows = range(start, min(start + ROW_GROUP, num_rows))
            images = [draw_image(rng, LONG_SIDE)[0] for _ in rows]
            ids = [f"img-{i:06d}" for i in rows]
            prompts = [f"describe image {i % 97}" for i in rows]
            writer.write_table(pa.table({"id": ids, "prompt": prompts, "image": images}, schema))
    return path.stat().st_size


class PeakSampler:
    """VmHWM of a process and its descendants, read every `interval_s` until it exits."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.peaks: dict[int, int] = {}  # pid -> VmHWM bytes, the last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            for pid in [self.pid, *descendants(self.pid)]:
                hwm = vm_hwm(pid)
                if hwm:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
            time.sleep(interval_s)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        job = self.peaks.get(self.pid, 0)
        others = {p: v for p, v in self.peaks.items() if p != self.pid}
        return {"job_peak_rss_mb": job / 2**20, "children_peak_rss_mb": max(others.values(), default=0) / 2**20}  # fmt: skip


def vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        todo += [int(c) for c in children]
    return found


def committed_parts(output: Path) -> int:
    results = output / "results"
    if not results.is_dir():
        return 0
    return sum(1 for p in results.rglob("*.parquet") if not p.name.startswith("."))


def run_job(command: list[str], output: Path, kill_after_parts: int | None) -> dict:
    """One run of the job: wall seconds, peak RSS, whether it was killed."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        sampler = PeakSampler(process.pid)
        killed = False
        while process.poll() is None:
            if kill_after_parts is not None and committed_parts(output) >= kill_after_parts:
                os.kill(process.pid, signal.SIGKILL)
                killed = True
                process.wait()
                break
            time.sleep(0.05)
        facts = sampler.stop()
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2000:]
    if not killed and process.returncode != 0:
        raise SystemExit(f"the job failed (exit {process.returncode}):\n{tail}")
    return {
        "wall_s": round(time.perf_counter() - start, 2),
        "killed": killed,
        "parts_at_end": committed_parts(output),
        **{k: round(v, 1) for k, v in facts.items()},
    }


def check_results(output: Path, num_rows: int) -> dict:
    """Every input id answered exactly once (else SystemExit naming what is wrong)."""
    from collections import Counter

    from tokenmill.pipelines.output import read_results

    rows = read_results(str(output)).to_pylist()
    counts = Counter(r["id"] for r in rows)
    expected = {f"img-{i:06d}" for i in range(num_rows)}
    missing = expected - counts.keys()
    duplicated = [i for i, n in counts.items() if n > 1]
    extra = counts.keys() - expected
    if missing or duplicated or extra:
        raise SystemExit(
            f"ids: {len(missing)} missing, {len(duplicated)} duplicated, {len(extra)} unknown"
        )
    errors = [r["error"] for r in rows if r["error"] is not None]
    return {
        "rows": len(rows),
        "ids_exactly_once": True,
        "error_rows": len(errors),
        "first_error": errors[0] if errors else None,
        "image_tokens": sum(r["image_tokens"] or 0 for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--model", default=None, help="a VLM directory (default: --tiny)")
    parser.add_argument("--tiny", default="qwen2.5-vl", choices=("qwen2.5-vl", "gemma3"))
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--shard-tokens", type=int, default=16_384)
    parser.add_argument("--kill-after-parts", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="work here, and keep it")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="tokenmill-images-job-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from tokenmill.bench.tiny_vlm import build_tiny_vlm

        model = str(build_tiny_vlm(args.tiny, work / "model"))
    source, output = work / "input.parquet", work / "output"
    started = time.perf_counter()
    input_bytes = write_input(source, args.rows, args.seed)
    print(f"wrote {args.rows} rows, {input_bytes / 2**20:.1f} MB, in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)  # fmt: skip
    command = [
        str(Path(sys.executable).with_name("tokenmill")), "run", str(source), str(output),
        "--model", model, "--raw", "--prompt-column", "prompt", "--id-column", "id",
        "--image-column", "image", "--max-tokens", str(args.max_tokens),
        "--shard-tokens", str(args.shard_tokens), "--dtype", "float32",
    ]  # fmt: skip
    runs = [run_job(command, output, args.kill_after_parts)]
    print(f"run 1: {runs[-1]}", file=sys.stderr)
    if runs[-1]["killed"]:
        runs.append(run_job(command, output, None))
        print(f"run 2 (resumed): {runs[-1]}", file=sys.stderr)
    summary = {
        "rows_in": args.rows,
        "input_mb": round(input_bytes / 2**20, 1),
        "model": model,
        "runs": runs,
        **check_results(output, args.rows),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
