"""An exception inside an engine step mid-shard, under the one rule of
pipelines/engine_failures.py: retry the shard once; then isolate the requests, failing
ones becoming error rows; a shard where every request fails fails the job, which a
rerun resumes. Other shards' parts are always kept."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.faults import FaultInjected
from tokenmill.pipelines.engine_failures import EngineBrokenError
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

ENGINE = {"kv_cache_memory": 8 << 20}
JOB = dict(id_column="id", max_tokens=4, shard_tokens=60, dtype="float32", engine_options=ENGINE)


def _run(fault_job, **options):
    return run_job(
        str(fault_job.input),
        str(fault_job.output),
        model=str(fault_job.model_dir),
        **JOB,
        **options,
    )


def _failing_step(monkeypatch, should_fail):
    """Make LLMEngine.step raise whenever `should_fail(engine, call_number)` is true."""
    step = LLMEngine.step
    calls = [0]

    def faulty(self):
        calls[0] += 1
        if should_fail(self, calls[0]):
            raise FaultInjected(f"injected engine fault at step {calls[0]}")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", faulty)
    return calls


def _answers(table):
    return dict(zip(table["id"].to_pylist(), table["output"].to_pylist()))


def test_transient_failure_is_retried_and_answers_are_unchanged(fault_job, tmp_path, monkeypatch):
    clean = _run(fault_job, output_format="parquet")
    expected = _answers(read_results(str(fault_job.output)))
    fault_job.output = tmp_path / "out-faulty"
    _failing_step(monkeypatch, lambda engine, n: n == 7)  # once, mid-shard
    ledger = _run(fault_job)
    results = read_results(str(fault_job.output))
    assert ledger.rows_failed == 0 and ledger.rows_ok == fault_job.num_rows
    assert _answers(results) == expected  # greedy: the retried shard gives the same answers
    assert ledger.completion_tokens == clean.completion_tokens
    assert fault_job.outcome().ok


def test_a_request_that_fails_again_becomes_an_error_row(fault_job, monkeypatch):
    poison = pq.read_table(fault_job.input)["prompt"][5].as_py()

    def has_poison(engine, n):
        return any(
            r.prompt_token_ids and _text(engine, r) == poison for r in engine._requests.values()
        )

    def _text(engine, request):
        return engine.tokenizer.decode(request.prompt_token_ids)

    _failing_step(monkeypatch, has_poison)
    ledger = _run(fault_job, raw=True)
    results = read_results(str(fault_job.output))
    rows = {r["id"]: r for r in results.to_pylist()}
    assert rows["id-5"]["finish_reason"] == "error"
    assert rows["id-5"]["error"].startswith("engine error: FaultInjected: injected engine fault")
    assert rows["id-5"]["prompt_tokens"] == 0 and rows["id-5"]["completion_tokens"] == 0
    others = [r for i, r in rows.items() if i != "id-5"]
    assert all(r["finish_reason"] in ("stop", "length") for r in others)
    assert ledger.rows_failed == 1 and ledger.rows_ok == fault_job.num_rows - 1
    assert fault_job.outcome().ok


def test_a_broken_engine_fails_the_job_keeps_other_shards_and_resumes(fault_job, monkeypatch):
    calls = _failing_step(monkeypatch, lambda engine, n: n > 12)  # after a shard or two
    with pytest.raises(EngineBrokenError, match=r"failed on each of its \d+ requests.*rerun"):
        _run(fault_job)
    kept = fault_job.published_parts()
    assert kept  # shards finished before the engine broke are published
    mtimes = {n: (fault_job.output / "results" / n).stat().st_mtime_ns for n in kept}
    assert calls[0] > 12
    monkeypatch.undo()
    ledger = _run(fault_job)
    assert ledger.num_shards_run == ledger.num_shards - len(kept)
    assert all(
        (fault_job.output / "results" / n).stat().st_mtime_ns == t for n, t in mtimes.items()
    )
    assert fault_job.outcome().ok and ledger.rows_failed == 0


@pytest.mark.slow
def test_engine_step_fault_through_the_cli(fault_job):
    result = fault_job.run("engine_step:5:raise")
    assert result.returncode == 0, result.output[-2000:]
    outcome = fault_job.outcome()
    assert outcome.ok and outcome.rows_failed == 0


def test_a_failed_generate_leaves_the_engine_clean(tiny_model_dir, monkeypatch):
    from tokenmill.engine.api.llm import LLM
    from tokenmill.engine.types.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6, [5, 6, 7, 8] * 5 + [12]]
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    _failing_step(monkeypatch, lambda engine, n: n == 3)
    with pytest.raises(FaultInjected):
        llm.generate(prompts, params)
    engine = llm.engine
    assert not engine.has_unfinished and not engine._requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.block_manager.cached
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
