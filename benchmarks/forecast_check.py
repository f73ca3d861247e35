"""The dry run's forecast against the real run, duplicates computed once, and the progress
ETA - on a job of a few hundred varied rows, through the CLI, as a user runs it.

    python benchmarks/forecast_check.py forecast [--rows 300] [--max-tokens 48]
    python benchmarks/forecast_check.py dedupe   [--rows 300] [--rounds 2]
    python benchmarks/forecast_check.py progress [--rows 300]
    python benchmarks/forecast_check.py embed    [--rows 300] [--embed-model all-minilm-l6-v2]

forecast  `tokenmill run ... --dry-run --json`, then the same job for real: prompt and
          cached tokens must be equal, the cost within [cost_min, cost_max]; prints the
          ratio of the forecast seconds to the ledger's device seconds. Then the same
          for a scoring job (`--task score`).
embed     the forecast check on an embedding job (`--task embed`, the rows' prompts as
          texts): an encoder caches nothing and generates nothing, so prompt tokens
          and cost must be exact and cached tokens 0.
dedupe    the job with and without `--no-dedupe`, alternating (A B A B): completion
          tokens and device seconds saved, and whether each copy's answer equals the
          answer its row got when computed itself.
progress  the job with the terminal progress recorded at every engine step: once 25%
          of the tokens are done, the ETA against the time that really remained and the
          tokens/s against the job's average; and the lines a terminal shows.

The rows: a few shared prefixes (the chat template's system prompt, a few-shot block
for classification rows), passages and questions of different lengths, and about one
row in eight an exact repeat of an earlier one. Figures go to docs/jobs.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))
PRICES = ["--price-input", "0.15", "--price-cached", "0.075", "--price-output", "0.6"]

FEW_SHOT = (
    "Classify the sentiment of the review as positive or negative.\n"
    "Review: The battery lasts all day and the screen is bright. Sentiment: positive\n"
    "Review: It broke after a week and support never answered. Sentiment: negative\n"
    "Review: Exactly as described, arrived early. Sentiment: positive\n"
)
REVIEWS = [
    "The fan is loud but it keeps the room cool",
    "Terrible fit, returned it the same day",
    "Best purchase I have made this year",
    "The colour faded after two washes",
    "Setup took five minutes and it just works",
    "Arrived broken and the box was crushed",
]
TOPICS = [
    "photosynthesis",
    "the French revolution",
    "compound interest",
    "how vaccines work",
    "the water cycle",
    "binary search",
    "plate tectonics",
    "supply and demand",
]
WORDS = [
    "the",
    "committee",
    "reviewed",
    "the",
    "proposal",
    "in",
    "detail",
    "and",
    "agreed",
    "that",
    "the",
    "budget",
    "would",
    "need",
    "another",
    "round",
    "of",
    "revisions",
    "before",
    "the",
    "final",
    "vote",
    "next",
    "month",
    "while",
    "several",
    "members",
    "asked",
    "for",
    "clearer",
    "figures",
    "on",
    "maintenance",
    "costs",
    "and",
    "staffing",
]


def varied_rows(num_rows: int, seed: int = 7) -> list[dict]:
    """Rows with ids: classification (a shared few-shot prefix), summaries of passages
    of different lengths, short questions; about one in eight repeats an earlier row."""
    rng = random.Random(seed)
    prompts: list[str] = []
    for i in range(num_rows):
        if i > 8 and rng.random() < 0.125:
            prompts.append(prompts[rng.randrange(len(prompts))])
            continue
        kind = i % 3
        if kind == 0:
            prompts.append(f"{FEW_SHOT}Review: {rng.choice(REVIEWS)} ({i}). Sentiment:")
        elif kind == 1:
            passage = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(15, 160)))
            prompts.append(f"Summarise in one sentence: {passage}")
        else:
            detail = " in simple words" * rng.randrange(0, 3)
            prompts.append(f"Explain {rng.choice(TOPICS)}{detail}. (question {i})")
    return [{"id": f"r{i:04d}", "prompt": p} for i, p in enumerate(prompts)]


def write_input(path: Path, num_rows: int) -> Path:
    rows = varied_rows(num_rows)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def tokenmill(*args: str) -> tuple[dict, float]:
    """Run `tokenmill run ... --json`; (its JSON, wall seconds)."""
    started = time.perf_counter()
    done = subprocess.run(
        [TOKENMILL, "run", *args, "--json"], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"tokenmill run {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout), seconds


def check_forecast(work: Path, source: Path, extra: list[str], label: str) -> dict:
    out = work / f"out-{label}"
    args = [str(source), str(out), "--id-column", "id", *PRICES, *extra]
    load = [os.getloadavg()[0]]
    forecast, dry_wall = tokenmill(*args, "--dry-run")
    load.append(os.getloadavg()[0])
    ledger, run_wall = tokenmill(*args)
    load.append(os.getloadavg()[0])
    figures = {
        "job": label,
        "rows": forecast["rows"],
        "rows_deduplicated": (forecast["rows_deduplicated"], ledger["rows_deduplicated"]),
        "prompt_tokens": (forecast["prompt_tokens"], ledger["prompt_tokens"]),
        "cached_tokens": (forecast["cached_tokens"], ledger["cached_tokens"]),
        "cached_tokens_exact": forecast["cached_tokens_exact"],
        "completion_tokens": (
            forecast["completion_tokens_min"],
            forecast["completion_tokens_estimate"],
            forecast["completion_tokens_max"],
            ledger["completion_tokens"],
        ),
        "cost": (
            forecast["cost_min"],
            forecast["cost_estimate"],
            forecast["cost_max"],
            ledger["cost_total"],
        ),
        "seconds_estimate": forecast["seconds_estimate"],
        "device_seconds": ledger["device_seconds"],
        "seconds_ratio": forecast["seconds_estimate"] / ledger["device_seconds"],
        "calibration": (forecast["calibration_rows"], forecast["calibration_seconds"]),
        "dry_run_wall_s": dry_wall,
        "run_wall_s": run_wall,
        # 1-minute load average before the dry run, between, after the run (2 cores)
        "load_average": [round(x, 1) for x in load],
    }
    figures["exact"] = (
        forecast["prompt_tokens"] == ledger["prompt_tokens"]
        and forecast["cached_tokens"] == ledger["cached_tokens"]
    )
    figures["cost_in_bounds"] = forecast["cost_min"] <= ledger["cost_total"] <= forecast["cost_max"]
    return figures


def run_forecast(args: argparse.Namespace, work: Path) -> None:
    source = write_input(work / "in.parquet", args.rows)
    tokens = ["--max-tokens", str(args.max_tokens)]
    print(json.dumps(check_forecast(work, source, tokens, "generate")))
    print(json.dumps(check_forecast(work, source, ["--task", "score"], "score")))


def run_embed(args: argparse.Namespace, work: Path) -> None:
    source = write_input(work / "in.parquet", args.rows)
    extra = ["--task", "embed", "--model", args.embed_model, "--prompt-column", "prompt"]
    print(json.dumps(check_forecast(work, source, extra, "embed")))


def run_dedupe(args: argparse.Namespace, work: Path) -> None:
    source = write_input(work / "in.parquet", args.rows)
    common = [str(source), "--id-column", "id", "--max-tokens", str(args.max_tokens)]
    common += ["--dtype", args.dtype]
    runs: dict[str, list[dict]] = {"dedupe": [], "no-dedupe": []}
    for round_ in range(args.rounds):
        for name, flags in (("dedupe", []), ("no-dedupe", ["--no-dedupe"])):
            out = work / f"out-{name}-{round_}"
            ledger, _ = tokenmill(common[0], str(out), *common[1:], *flags)
            runs[name].append(ledger)
    with_copies = pq.read_table(work / "out-dedupe-0" / "results").to_pylist()
    each = {r["id"]: r for r in pq.read_table(work / "out-no-dedupe-0" / "results").to_pylist()}
    copies = [r for r in with_copies if r["duplicate_of"] is not None]
    same = sum(1 for r in copies if r["output"] == each[r["id"]]["output"])
    # computing each row twice is not always one answer: in bf16 a duplicate whose prompt
    # is all cached computes its last token in a step of another shape than its source
    self_same = sum(
        1 for r in copies if each[r["id"]]["output"] == each[r["duplicate_of"]]["output"]
    )
    rest = [r for r in with_copies if r["duplicate_of"] is None]
    rest_same = sum(1 for r in rest if r["output"] == each[r["id"]]["output"])
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    print(
        json.dumps(
            {
                "rows": len(with_copies),
                "rows_deduplicated": len(copies),
                "dtype": args.dtype,
                "copies_equal_to_computing_each": f"{same}/{len(copies)}",
                "computed_twice_equal_to_its_source": f"{self_same}/{len(copies)}",
                "other_rows_equal_across_runs": f"{rest_same}/{len(rest)}",
                "completion_tokens": [r["completion_tokens"] for r in runs["dedupe"]]
                + [r["completion_tokens"] for r in runs["no-dedupe"]],
                "prompt_tokens": (
                    runs["dedupe"][0]["prompt_tokens"],
                    runs["no-dedupe"][0]["prompt_tokens"],
                ),
                "device_seconds_dedupe": [r["device_seconds"] for r in runs["dedupe"]],
                "device_seconds_no_dedupe": [r["device_seconds"] for r in runs["no-dedupe"]],
                "device_seconds_ratio": median([r["device_seconds"] for r in runs["no-dedupe"]])
                / median([r["device_seconds"] for r in runs["dedupe"]]),
            }
        )
    )


def run_progress(args: argparse.Namespace, work: Path) -> None:
    """The job in this process with the terminal progress, each step's snapshot kept."""
    from rich.console import Console

    from tokenmill.cli.progress import TerminalProgress
    from tokenmill.pipelines.job import run_job

    class Recorded(TerminalProgress):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.snapshots: list[tuple[float, object]] = []

        def step(self, tokens) -> None:
            super().step(tokens)
            self.snapshots.append((time.perf_counter(), self.counter.snapshot()))

    source = write_input(work / "in.parquet", args.rows)
    log = work / "terminal.txt"
    with open(log, "w") as stream:
        progress = Recorded(console=Console(file=stream, width=120, force_terminal=True))
        ledger = run_job(
            str(source),
            str(work / "out"),
            progress=progress,
            id_column="id",
            max_tokens=args.max_tokens,
            price_input=0.15,
            price_output=0.6,
        )
        progress.close()
    end, last = progress.snapshots[-1]
    start = end - last.seconds
    total = last.tokens_done
    average = total / last.seconds
    checks = []
    for share in (0.25, 0.5, 0.75):
        at, snap = next(
            (t, s) for t, s in progress.snapshots if s.tokens_done >= share * s.tokens_total
        )
        remaining = end - at
        checks.append(
            {
                "tokens_done_share": round(snap.tokens_done / snap.tokens_total, 3),
                "at_s": round(at - start, 2),
                "eta_s": round(snap.eta_s, 2),
                "remaining_s": round(remaining, 2),
                "eta_over_remaining": round(snap.eta_s / remaining, 3),
                "tokens_per_s": round(snap.tokens_per_s, 1),
                "job_average_tokens_per_s": round(average, 1),
                "rate_over_average": round(snap.tokens_per_s / average, 3),
            }
        )
    print(
        json.dumps({"rows": args.rows, "device_seconds": ledger.device_seconds, "checks": checks})
    )
    print(f"terminal capture: {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["forecast", "dedupe", "progress", "embed"])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="dedupe: the model dtype")
    parser.add_argument("--embed-model", default="all-minilm-l6-v2", help="embed: the model")
    parser.add_argument("--work", type=Path, default=None, help="keep outputs here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="tokenmill-forecast-"))
    work.mkdir(parents=True, exist_ok=True)
    checks = {
        "forecast": run_forecast,
        "dedupe": run_dedupe,
        "progress": run_progress,
        "embed": run_embed,
    }
    checks[args.check](args, work)


if __name__ == "__main__":
    main()
