"""Progress counted per engine step: the engine's on_step hook, the counter's tokens,
rate and ETA, and what `tokenmill run` prints (stage lines from the start, one bar,
nothing with --json)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner
from rich.console import Console

from tokenmill.cli import main
from tokenmill.cli.progress import TerminalProgress, clock
from tokenmill.engine.types.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.progress import ProgressCounter, StepTokens, step_counter

ENGINE = ["--engine-option", f"kv_cache_memory={8 << 20}", "--dtype", "float32"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _output(completion_tokens: int) -> RequestOutput:
    completion = CompletionOutput(0, "x", [5] * completion_tokens, "stop")
    return RequestOutput("0", None, [1], [completion], 1, 0, completion_tokens, RequestMetrics(0))


def test_on_step_reports_the_engines_counters_after_every_step(tiny_model_dir):
    from tokenmill.engine.api.llm import LLM

    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    seen: list[tuple[int, int]] = []
    outputs = llm.generate(
        [[5, 6, 7, 8], [5, 6, 9]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        on_step=lambda stats: seen.append((stats.computed_prompt_tokens, stats.generated_tokens)),
    )
    assert len(seen) == llm.stats().num_steps
    assert seen[-1] == (7, 8) and sum(o.completion_tokens for o in outputs) == 8
    assert [g for _, g in seen] == sorted(g for _, g in seen)  # counted as they go


def test_step_counter_turns_cumulative_counters_into_each_steps_tokens():
    stats = EngineStats(computed_prompt_tokens=10, cached_prompt_tokens=4, generated_tokens=2)
    delta = step_counter(stats)
    stats.computed_prompt_tokens, stats.generated_tokens = 30, 5
    assert delta(stats) == StepTokens(prompt_computed=20, prompt_cached=0, generated=3)
    stats.cached_prompt_tokens = 16
    assert delta(stats) == StepTokens(0, 12, 0)


def test_counter_tokens_rate_eta_and_tightening():
    clock_ = Clock()
    counter = ProgressCounter(
        rows_total=4,
        tokens_total=400,  # 4 rows: 60 prompt tokens + a budget of 40 each
        budget_per_row=40,
        prices=Prices(input_per_1m=1.0, output_per_1m=2.0),
        clock=clock_,
    )
    assert counter.snapshot().eta_s is None and counter.snapshot().tokens_per_s is None
    clock_.now += 2
    counter.step(StepTokens(prompt_computed=240))
    snap = counter.snapshot()  # one step timed: tokens left over the rate so far
    assert snap.eta_s == (400 - 240) * 2 / 240 and snap.tokens_per_s == 400 / (2 + snap.eta_s)
    clock_.now += 1
    counter.step(StepTokens(generated=4))
    snap = counter.snapshot()
    assert (snap.tokens_done, snap.tokens_total, snap.rows_done) == (244, 400, 0)
    assert snap.cost == (240 * 1.0 + 4 * 2.0) / 1e6
    counter.request_done(_output(10))  # stopped 30 tokens short of its budget
    snap = counter.snapshot()
    assert (snap.tokens_total, snap.rows_done) == (370, 1)
    counter.shard_done(planned_tokens=400, billed_tokens=300, num_rows=4)
    snap = counter.snapshot()
    assert (snap.tokens_done, snap.tokens_total, snap.rows_done, snap.eta_s) == (300, 300, 4, 0)


def test_no_prices_no_cost():
    counter = ProgressCounter(rows_total=1, tokens_total=10, prices=Prices())
    counter.step(StepTokens(generated=3))
    assert counter.snapshot().cost is None


def test_terminal_progress_prints_stages_and_a_tokens_bar(tmp_path, tiny_model_dir):
    from tokenmill.engine.api.llm import LLM

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"Question {i}?" for i in range(12)]}), src)
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=False)
    progress = TerminalProgress(console=console)
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    run_job(str(src), str(tmp_path / "out"), llm=llm, progress=progress, max_tokens=5)
    progress.close()
    text = buffer.getvalue()
    assert "planning" in text and "planned 12 rows into 1 shard" in text
    assert "writing the ledger" in text
    snap = progress.counter.snapshot()
    assert snap.rows_done == 12 and snap.tokens_done == snap.tokens_total > 0
    assert f"{snap.tokens_done:,}/{snap.tokens_total:,} tok  12/12 rows" in progress.line()
    buffer.truncate(0)
    # the same job again: nothing to compute, no bar
    progress = TerminalProgress(console=console)
    run_job(str(src), str(tmp_path / "out"), llm=llm, progress=progress, max_tokens=5)
    assert "all 1 shard already complete: nothing to compute" in buffer.getvalue()
    assert progress.counter is None


def test_json_runs_print_nothing_but_the_json(tmp_path, tiny_model_dir):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["Hi there", "Hi there", "Hello"]}), src)
    runner = CliRunner()
    args = ["run", str(src), str(tmp_path / "out"), "--model", str(tiny_model_dir), *ENGINE]
    result = runner.invoke(main, [*args, "--max-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert result.output.lstrip().startswith("{") and result.stderr == ""
    result = runner.invoke(main, [*args, "--max-tokens", "3"])
    assert "0.0s  tokenmill run" in result.stderr  # the first line, before any import
    assert "no prices set" in result.stdout


def test_clock_format():
    assert clock(None) == "-:--:--" and clock(59.6) == "0:01:00" and clock(3725) == "1:02:05"


def test_eta_prices_the_work_left_not_the_rate_so_far():
    """100 rows: 4,000 prompt tokens (half served from the cache) done in two steps,
    then 40 decode steps of 100 tokens. A third of the tokens is done after the prompt
    steps - and most of the time is still ahead: the ETA must say so."""
    clock_ = Clock()
    counter = ProgressCounter(
        rows_total=100,
        tokens_total=4000 + 100 * 40,
        prompt_total=4000,
        budget_per_row=40,
        clock=clock_,
    )
    per_step, per_token = 0.4, 0.001

    def run(prompt_computed: int, prompt_cached: int, generated: int) -> None:
        clock_.now += per_step + per_token * (prompt_computed + generated)
        counter.step(StepTokens(prompt_computed, prompt_cached, generated))

    run(1000, 1000, 50)
    run(1000, 1000, 50)
    run(0, 0, 100)
    snap = counter.snapshot()
    assert snap.tokens_done >= 0.25 * snap.tokens_total
    naive = (snap.tokens_total - snap.tokens_done) * snap.seconds / snap.tokens_done
    remaining = 38 * (per_step + per_token * 100)  # 38 decode steps of 100 rows
    assert naive < remaining / 2  # tokens left over the rate so far: far too soon
    assert abs(snap.eta_s / remaining - 1) < 0.1
    average = snap.tokens_total / (snap.seconds + remaining)
    assert abs(snap.tokens_per_s / average - 1) < 0.1
