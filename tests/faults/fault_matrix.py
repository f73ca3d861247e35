"""The fault matrix: each fault scenario run N times, rows lost and rows duplicated.

    python tests/faults/fault_matrix.py                    # every scenario, 5 runs each
    python tests/faults/fault_matrix.py --runs 10 --seed 7 --only kill

Each run is a fresh 40-row `tokenmill run` job (the CLI, in child processes) on a tiny
random Llama model built in the work directory (an embedding job's scenarios: `--task
embed` on a tiny random BERT embedding model; the MoE ones: a tiny random Qwen3-MoE; the
image job's: a tiny random Gemma 3 vision model over an image column), with a fault injected through
TOKENMILL_FAULT_POINT (`tokenmill/faults.py`) or from outside (a filled disk, a second
run, an edited input). After the scenario's recovery step (a rerun, freeing space,
--no-resume) a reader counts, against the input's ids: rows lost, rows duplicated,
temporary files visible, and whether the ledger equals the rows. A run "fails" when the
scenario's own expectations (the kill happened, the refusal said why, ...) do not hold.
The target is 0 lost and 0 duplicated in every run.

Adding a scenario: write `def my_fault(ctx: RunContext) -> Outcome` (use `ctx.job`, a
fresh FaultJob, and `ctx.rng`), then append one `Scenario(...)` to SCENARIOS.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "faults"), str(TESTS / "batch_api")]

from fault_jobs import (  # noqa: E402
    FaultJob,
    NoSmallDisk,
    Outcome,
    build_embedding_model,
    build_moe_model,
    fill_after_first_part,
    kill_and_resume,
    shape_killed_and_resumed,
    small_disk,
    vision_job,
    write_input,
)
from tiny_model import build_tiny_model  # noqa: E402


@dataclass
class RunContext:
    """What one run of a scenario gets: a fresh job and directory, and a seeded RNG."""

    job: FaultJob
    workdir: Path
    rng: random.Random


@dataclass(frozen=True)
class Scenario:
    name: str  # the fault, as the README table names it
    run: Callable[[RunContext], Outcome]


class ScenarioUnavailable(RuntimeError):
    """The scenario cannot run on this machine (e.g. mounting a tmpfs needs root)."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# -- the scenarios ----------------------------------------------------------------------


def kills(ctx: RunContext) -> Outcome:
    """SIGKILL at 5 random points in a row, resuming after each."""
    kill_and_resume(ctx.job, ctx.rng, num_points=5)
    return ctx.job.outcome()


def engine_transient(ctx: RunContext) -> Outcome:
    """One engine step raises mid-shard: the shard is retried, no error row."""
    result = ctx.job.run(f"engine_step:{ctx.rng.randint(2, 30)}:raise")
    _expect(result.returncode == 0, result.output[-1500:])
    outcome = ctx.job.outcome()
    _expect(outcome.rows_failed == 0, "a transient engine fault left error rows")
    return outcome


def engine_broken(ctx: RunContext) -> Outcome:
    """Every engine step raises from a random one on: the job fails, a rerun resumes."""
    result = ctx.job.run(f"engine_step:{ctx.rng.randint(5, 30)}+:raise")
    _expect(result.returncode == 1 and "rerun the job" in result.output, result.output[-1500:])
    rerun = ctx.job.run()
    _expect(rerun.returncode == 0, rerun.output[-1500:])
    return ctx.job.outcome()


def disk_full(ctx: RunContext) -> Outcome:
    """The output's tmpfs fills up after the first part; space freed; rerun."""
    try:
        mounted = small_disk(ctx.workdir / "disk")
        disk = mounted.__enter__()
    except NoSmallDisk as exc:
        raise ScenarioUnavailable(str(exc)) from None
    try:
        job = FaultJob(
            ctx.job.model_dir, ctx.job.input, disk / "out", extra_args=["--max-tokens", "12"]
        )
        returncode, output, ballast = fill_after_first_part(job, disk)
        _expect(returncode == 1 and "no space left" in output, output[-1500:])
        ballast.unlink()
        rerun = job.run()
        _expect(rerun.returncode == 0, rerun.output[-1500:])
        return job.outcome()
    finally:
        mounted.__exit__(None, None, None)


def concurrent(ctx: RunContext) -> Outcome:
    """A second run (another input) on the output while the first runs: refused."""
    first = ctx.job.start(f"engine_step:{ctx.rng.randint(1, 10)}:stall", stall_s=4)
    try:
        while not (ctx.job.output / "_input.json").exists():
            _expect(first.poll() is None, "the first run ended before the second started")
            time.sleep(0.02)
        other = write_input(ctx.workdir / "other.parquet", variant="-other")
        second = FaultJob(ctx.job.model_dir, other, ctx.job.output).run()
        _expect(second.returncode == 1 and "is in use by" in second.output, second.output[-1500:])
        output, _ = first.communicate(timeout=300)
        _expect(first.returncode == 0, output[-1500:])
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    return ctx.job.outcome()


def changed_input(ctx: RunContext) -> Outcome:
    """Killed after a random part; the input is rewritten; resume refused; --no-resume."""
    # From the 2nd part on: a run killed before publishing any part left nothing to mix,
    # and its rerun rightly starts over on the new input without asking.
    killed = ctx.job.run(f"write@/results/:{ctx.rng.randint(2, 6)}")
    _expect(killed.killed, killed.output[-1500:])
    write_input(ctx.job.input, ctx.job.num_rows + 4, variant="-v2")
    ctx.job.num_rows += 4
    refused = ctx.job.run()
    _expect(
        refused.returncode == 1 and "the input changed" in refused.output, refused.output[-1500:]
    )
    fresh = ctx.job.run(None, "--no-resume")
    _expect(fresh.returncode == 0, fresh.output[-1500:])
    return ctx.job.outcome()


def input_shapes(ctx: RunContext) -> Outcome:
    """Each input shape (bare-CR CSV, a JSON array with bad elements, other delimiters,
    blank lines: tests/input_shapes.py) killed at a random engine step and resumed:
    every row answered or named as an error, and the ledger's record counts add up."""
    from input_shapes import write_input_shapes

    total = Outcome(0, 0, [], True)
    for shape in write_input_shapes(ctx.workdir / "shapes"):
        fault = f"engine_step:{ctx.rng.randint(1, 3)}"
        outcome = shape_killed_and_resumed(
            ctx.job.model_dir, shape, ctx.workdir / f"out-{shape.path.name}", fault
        )
        total.rows_lost += outcome.rows_lost
        total.rows_duplicated += outcome.rows_duplicated
        total.temp_files += outcome.temp_files
        total.ledger_matches = total.ledger_matches and outcome.ledger_matches
        total.problems += [f"{shape.path.name}: {p}" for p in outcome.problems]
    return total


def embedding(scenario: Callable[[RunContext], Outcome]) -> Callable[[RunContext], Outcome]:
    """`scenario` on an embedding job (`--task embed`, a tiny BERT embedding model built
    once in the work directory) instead of a generation job."""

    def run(ctx: RunContext) -> Outcome:
        model_dir = build_embedding_model(ctx.workdir.parent / "encoder")
        job = FaultJob(model_dir, ctx.job.input, ctx.job.output, task="embed")
        return scenario(RunContext(job, ctx.workdir, ctx.rng))

    return run


def moe(scenario: Callable[[RunContext], Outcome]) -> Callable[[RunContext], Outcome]:
    """`scenario` on a generation job over a tiny random Qwen3-MoE (built once in the work
    directory) instead of the tiny Llama."""

    def run(ctx: RunContext) -> Outcome:
        model_dir = build_moe_model(ctx.workdir.parent / "moe")
        job = FaultJob(model_dir, ctx.job.input, ctx.job.output)
        return scenario(RunContext(job, ctx.workdir, ctx.rng))

    return run


def vision(scenario: Callable[[RunContext], Outcome]) -> Callable[[RunContext], Outcome]:
    """`scenario` on an image job (a tiny random Gemma 3 vision model built once in the
    work directory) whose rows hold hostile images among good ones: a decompression bomb,
    a truncated PNG, a text file, a path out of the image root - each an error row."""

    def run(ctx: RunContext) -> Outcome:
        job = vision_job(ctx.workdir.parent, ctx.job)
        outcome = scenario(RunContext(job, ctx.workdir, ctx.rng))
        _expect(outcome.rows_failed == 6, f"{outcome.rows_failed} error rows, not the 6 hostile")
        return outcome

    return run


def _store_side(name: str, **kwargs) -> Callable[[RunContext], Outcome]:
    """A scenario of tests/faults/scenarios_b.py (its own moto S3 server, fault proxy or
    Dask cluster; the worker-death one needs PREFECT_API_URL), run once with this run's
    seed. Those functions count rows lost and duplicated against the input's ids; their
    tests check the ledger and temporary objects, so here a run fails on rows alone."""

    def run(ctx: RunContext) -> Outcome:
        import scenarios_b

        scenario = scenarios_b.SCENARIOS[name]
        if "seed" in scenario.__code__.co_varnames:
            kwargs.setdefault("seed", ctx.rng.randrange(1 << 30))
        lost, duplicated = scenario(**kwargs)
        return Outcome(lost, duplicated, temp_files=[], ledger_matches=True)

    return run


def batch_api_killed(on_s3: bool) -> Callable[[RunContext], Outcome]:
    """`tokenmill batch-api` SIGKILLed mid-batch and started again on the same store
    (tests/batch_api/api_faults.py): the running batch and the one queued behind it,
    every custom_id answered once."""

    def run(ctx: RunContext) -> Outcome:
        from api_faults import kill_and_restart

        if not on_s3:
            found = kill_and_restart(
                ctx.workdir, ctx.job.model_dir, str(ctx.workdir / "store"), rng=ctx.rng
            )
        else:
            from s3_server import moto_s3

            with moto_s3(bucket="fault-matrix-batch-api") as s3:
                found = kill_and_restart(
                    ctx.workdir,
                    ctx.job.model_dir,
                    s3.url(ctx.workdir.name),
                    storage_options=s3.storage_options,
                    rng=ctx.rng,
                )
        _expect(found.statuses == ["completed", "completed"], f"batches ended {found.statuses}")
        return Outcome(found.lost, found.duplicated, [], True, rows_failed=found.errors)

    return run


SCENARIOS: list[Scenario] = [
    Scenario(
        "SIGKILL at 5 random points (planning, mid-shard, part/stats/plan/ledger writes), resumed",
        kills,
    ),
    Scenario("engine step raises once mid-shard", engine_transient),
    Scenario("engine raises on every step from a random one on, then rerun", engine_broken),
    Scenario("output disk full mid-job, space freed, rerun", disk_full),
    Scenario("second run on the same output while the first runs", concurrent),
    Scenario("input changed between a kill and the resume, then --no-resume", changed_input),
    Scenario(
        "object store: resets, 500s and 503 SlowDown on reads and writes (through a proxy)",
        _store_side("store_transient"),
    ),
    Scenario(
        "object store: every part PUT 503 past the retry budget, then healed and rerun",
        _store_side("store_past_budget"),
    ),
    Scenario(
        "object store: 20% of requests stalled past the read timeout, rerun if it failed",
        _store_side("store_random", kind="stall"),
    ),
    Scenario(
        "Dask worker SIGKILLed inside a shard (flow, LocalCluster, Prefect server)",
        _store_side("worker_death"),
    ),
    Scenario(
        "Dask worker SIGKILLed inside a shard, `dask scheduler` + `dask worker` processes "
        "(--resources engine=1); its nanny restarts it",
        _store_side("worker_death", operator="restarted"),
    ),
    Scenario(
        "Dask worker SIGKILLed inside a shard, `dask worker --no-nanny` processes: it never "
        "comes back, the other worker finishes",
        _store_side("worker_death", operator="never-back"),
    ),
    Scenario(
        "`dask scheduler` SIGKILLed after 2 parts, restarted on its address (workers too): "
        "the flow fails naming it, rerun",
        _store_side("scheduler_restart"),
    ),
    Scenario(
        "object store down (every request reset) for 3 s after the first part, then back; "
        "rerun if it failed",
        _store_side("store_outage"),
    ),
    Scenario("embed job: SIGKILL at 5 random points, resumed", embedding(kills)),
    Scenario("embed job: engine step raises once mid-shard", embedding(engine_transient)),
    Scenario(
        "embed job: engine raises on every step from a random one on, then rerun",
        embedding(engine_broken),
    ),
    Scenario(
        "embed job: object store resets, 500s and 503 SlowDown (through a proxy)",
        _store_side("store_transient", task="embed"),
    ),
    Scenario(
        "embed job: object store, every part PUT 503 past the retry budget, then rerun",
        _store_side("store_past_budget", task="embed"),
    ),
    Scenario(
        "embed job: object store, 20% of requests stalled past the read timeout",
        _store_side("store_random", kind="stall", task="embed"),
    ),
    Scenario("MoE generation job: SIGKILL at 5 random points, resumed", moe(kills)),
    Scenario("MoE generation job: engine step raises once mid-shard", moe(engine_transient)),
    Scenario(
        "image job (bomb, truncated, text, path out of the root): SIGKILL at 5 points, resumed",
        vision(kills),
    ),
    Scenario("hostile row ids (../../x, absolute, NUL, 5,000 chars)", _store_side("hostile_ids")),
    Scenario(
        "hostile input bytes (invalid UTF-8 in JSONL, CSV and gzipped CSV; a 40 MB CSV field)",
        _store_side("hostile_bytes"),
    ),
    Scenario(
        "input shapes (bare-CR CSV, JSON array with bad elements, semicolon, pipe and tab "
        "delimiters, blank lines), each killed mid-job and resumed",
        input_shapes,
    ),
    Scenario(
        "batch-api server SIGKILLed mid-batch, restarted (local store)", batch_api_killed(False)
    ),
    Scenario(
        "batch-api server SIGKILLed mid-batch, restarted (loopback S3 store)",
        batch_api_killed(True),
    ),
]


# -- running the matrix -------------------------------------------------------------------


@dataclass
class Row:
    name: str
    runs: int = 0
    lost: int = 0
    duplicated: int = 0
    failed_runs: int = 0
    seconds: float = 0.0
    note: str = ""


def run_matrix(scenarios: list[Scenario], runs: int, seed: int, workdir: Path) -> list[Row]:
    model_dir = build_tiny_model(workdir / "model")
    rows = []
    for index, scenario in enumerate(scenarios):
        row = Row(scenario.name)
        for run in range(runs):
            rng = random.Random(f"{seed}-{index}-{run}")
            run_dir = workdir / f"s{index}-r{run}"
            run_dir.mkdir()
            job = FaultJob(model_dir, write_input(run_dir / "in.parquet"), run_dir / "out")
            started = time.perf_counter()
            try:
                outcome = scenario.run(RunContext(job, run_dir, rng))
            except ScenarioUnavailable as exc:
                row.note = str(exc)
                break
            except AssertionError as exc:
                row.runs += 1
                row.failed_runs += 1
                print(f"  {scenario.name} run {run} FAILED: {str(exc)[-600:]}", file=sys.stderr)
                continue
            finally:
                row.seconds += time.perf_counter() - started
            row.runs += 1
            row.lost += outcome.rows_lost
            row.duplicated += outcome.rows_duplicated
            if not outcome.ok:
                row.failed_runs += 1
                print(f"  {scenario.name} run {run}: {outcome}", file=sys.stderr)
        print(
            f"{scenario.name}: {row.runs} runs, {row.lost} lost, {row.duplicated} duplicated, "
            f"{row.failed_runs} failed, {row.seconds:.0f}s",
            file=sys.stderr,
        )
        rows.append(row)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| fault | runs | rows lost | rows duplicated | runs failing a check |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        runs = str(r.runs) if not r.note else f"0 ({r.note[:60]})"
        lines.append(f"| {r.name} | {runs} | {r.lost} | {r.duplicated} | {r.failed_runs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each scenario (default 5)")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    parser.add_argument("--only", default="", help="only scenarios whose name contains this")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp directory")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"fault matrix: seed {seed}, {args.runs} runs per scenario", file=sys.stderr)
    scenarios = [s for s in SCENARIOS if args.only.lower() in s.name.lower()]
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = run_matrix(scenarios, args.runs, seed, workdir)
    print(table(rows))
    print(
        f"\n(seed {seed}; rerun with: python tests/faults/fault_matrix.py --runs {args.runs} --seed {seed})"
    )
    if any(r.lost or r.duplicated or r.failed_runs for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
