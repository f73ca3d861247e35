"""Exact duplicates computed once: which rows are copies, the copy shards, the billing
rule (a copy bills nothing, so the ledger still equals the rows), resume."""

from __future__ import annotations

from array import array

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.pipelines.dedupe import Deduplicator, is_deterministic
from tokenmill.pipelines.job import plan_job, prepare_output, run_job, run_shard
from tokenmill.pipelines.output import read_ledger, read_results
from tokenmill.pipelines.plan import plan_shards
from tokenmill.pipelines.planning import load_shard
from tokenmill.pipelines.running import copies_ready
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spill import shard_rows
from tokenmill.pipelines.tokenize import PromptRow

# Row i asks QUESTIONS[i % 3] - rows 3.. repeat rows 0..2 - except row 7, which is its own.
QUESTIONS = ["What is two plus two?", "Name a colour.", "Why is the sky blue, briefly?"]


def _prompts(n: int = 12) -> list[str]:
    return ["Something else entirely" if i == 7 else QUESTIONS[i % 3] for i in range(n)]


def _write(path, prompts, **extra):
    ids = [f"q{i}" for i in range(len(prompts))]
    pq.write_table(pa.table({"id": ids, "prompt": prompts, **extra}), path)
    return str(path)


def _row(i: int, tokens: list[int], params_index: int = 0) -> PromptRow:
    return PromptRow(i, f"r{i}", token_ids=array("i", tokens), params_index=params_index)


def test_deterministic_means_greedy_a_seed_or_prompt_only():
    assert is_deterministic(SamplingParams(temperature=0))
    assert is_deterministic(SamplingParams(temperature=0.8, seed=3))
    assert is_deterministic(SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert not is_deterministic(SamplingParams(temperature=0.8))


def test_the_first_row_in_input_order_is_the_source_across_windows():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, max_tokens=3)]
    dedupe = Deduplicator(params)
    window0 = [_row(0, [5, 6]), _row(1, [7]), _row(2, [5, 6]), _row(3, [5, 6], params_index=1)]
    keep = dedupe.split(window0)
    # row 3 has other params: not a copy of row 0
    assert [r.row_index for r in keep] == [0, 1, 3]
    planned = plan_shards(keep, params, model_key="m", shard_tokens=5)
    copies = dedupe.sources_cut(planned)
    where = {r.row_index: p.shard.shard_id for p in planned for r in p.rows}
    assert [(c.row.row_index, c.source_row_index, c.source_shard) for c in copies] == [
        (2, 0, where[0])
    ]
    window1 = [_row(4, [7]), _row(5, [5, 6], params_index=1), _row(6, [8]), _row(7, [8])]
    keep = dedupe.split(window1)
    assert [r.row_index for r in keep] == [6]
    planned1 = plan_shards(keep, params, model_key="m", shard_tokens=50, first_index=9)
    copies = dedupe.sources_cut(planned1)
    assert [(c.row.row_index, c.source_row_index, c.source_shard) for c in copies] == [
        (4, 1, where[1]),
        (5, 3, where[3]),
        (7, 6, planned1[0].shard.shard_id),
    ]
    assert dedupe.num_copies == 4 and len(dedupe.index) == 4


def test_copies_take_their_sources_answer_and_bill_nothing(tmp_path, fake_llm):
    src = _write(tmp_path / "in.parquet", _prompts(), topic=[f"t{i}" for i in range(12)])
    out = str(tmp_path / "out")
    # windows of 5 rows: most sources sit in another window (and shard) than their copies
    ledger = run_job(
        src, out, llm=fake_llm, id_column="id", passthrough=["topic"], plan_window_rows=5
    )
    assert sum(fake_llm.calls) == 4  # the three questions and row 7
    rows = {r["id"]: r for r in read_results(out).to_pylist()}
    assert sorted(rows) == sorted(f"q{i}" for i in range(12))
    for i in range(12):
        row = rows[f"q{i}"]
        assert row["topic"] == f"t{i}"
        if i < 3 or i == 7:
            assert row["duplicate_of"] is None and row["prompt_tokens"] > 0
            continue
        source = rows[f"q{i % 3}"]
        assert row["duplicate_of"] == f"q{i % 3}"
        assert (row["output"], row["finish_reason"]) == (source["output"], source["finish_reason"])
        assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (0, 0, 0)
    assert ledger.rows_deduplicated == 8 and ledger.rows_ok == 12
    table = read_results(out)
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        assert getattr(ledger, name) == sum(table[name].to_pylist())
    assert read_ledger(out).rows_deduplicated == 8


def test_sampled_rows_without_a_seed_are_never_deduplicated(tmp_path, fake_llm):
    src = _write(tmp_path / "in.parquet", _prompts(6))
    ledger = run_job(src, str(tmp_path / "a"), llm=fake_llm, temperature=0.7)
    assert ledger.rows_deduplicated == 0 and sum(fake_llm.calls) == 6
    assert "duplicate_of" not in read_results(str(tmp_path / "a")).column_names
    ledger = run_job(src, str(tmp_path / "b"), llm=fake_llm, temperature=0.7, seed=11)
    assert ledger.rows_deduplicated == 3 and sum(fake_llm.calls) == 6 + 3


def test_no_dedupe_computes_every_row(tmp_path, fake_llm):
    src = _write(tmp_path / "in.parquet", _prompts(6))
    ledger = run_job(src, str(tmp_path / "out"), llm=fake_llm, dedupe=False)
    assert ledger.rows_deduplicated == 0 and sum(fake_llm.calls) == 6
    assert "duplicate_of" not in read_results(str(tmp_path / "out")).column_names


def test_copies_keep_their_own_decode_replaced_flag_in_the_jobs_schema(tmp_path, fake_llm):
    # b and d are the same text once their bad byte is replaced: d is b's copy, in a copy
    # shard whose part must have the compute shards' columns and types.
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'{"id": "a", "prompt": "first"}\n'
        b'{"id": "b", "prompt": "b\xffd"}\n'
        b'{"id": "c", "prompt": "first"}\n'
        b'{"id": "d", "prompt": "b\xffd"}\n'
    )
    out = str(tmp_path / "out")
    ledger = run_job(
        str(src), out, llm=fake_llm, id_column="id", on_decode_error="replace", plan_window_rows=2
    )
    assert ledger.rows_deduplicated == 2
    parts = sorted((tmp_path / "out" / "results").glob("*.parquet"))
    schemas = {pq.read_schema(p) for p in parts}
    assert len(parts) >= 2 and len(schemas) == 1
    rows = {r["id"]: r for r in read_results(out).to_pylist()}
    assert {i: (r["duplicate_of"], r["decode_replaced"]) for i, r in rows.items()} == {
        "a": (None, False),
        "b": (None, True),
        "c": ("a", False),
        "d": ("b", True),
    }


def test_copy_shards_come_last_and_wait_for_their_sources(tmp_path, fake_llm):
    src = _write(tmp_path / "in.parquet", _prompts())
    spec = JobSpec(src, str(tmp_path / "out"), id_column="id", plan_window_rows=5)
    plan = plan_job(spec, llm=fake_llm)
    kinds = [s.is_copy for s in plan.shards]
    assert kinds == sorted(kinds) and kinds[-1]  # compute shards, then copy shards
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    assert plan.rows_deduplicated == 8
    prepare_output(plan)
    first_copy = next(s for s in plan.shards if s.is_copy)
    with pytest.raises(RuntimeError, match="which is not complete"):
        run_shard(fake_llm, plan, first_copy)


def test_a_run_killed_before_the_copies_resumes_them_exactly_once(tmp_path, fake_llm):
    src = _write(tmp_path / "in.parquet", _prompts())
    out = str(tmp_path / "out")
    plan = plan_job(JobSpec(src, out, id_column="id", plan_window_rows=5), llm=fake_llm)
    prepare_output(plan)
    compute = [s for s in plan.shards if not s.is_copy]
    for shard in compute:
        run_shard(fake_llm, plan, shard)
    calls = sum(fake_llm.calls)
    # the run dies here; the rerun computes nothing and writes only the copies
    ledger = run_job(src, out, llm=fake_llm, id_column="id", plan_window_rows=5)
    assert sum(fake_llm.calls) == calls
    assert ledger.num_shards_run == len(plan.shards) - len(compute)
    ids = read_results(out)["id"].to_pylist()
    assert sorted(ids) == sorted(f"q{i}" for i in range(12))
    assert ledger.rows_deduplicated == 8


def test_a_copy_shard_is_ready_when_its_last_source_is_published(tmp_path, fake_llm):
    # Copies are written by whoever publishes their last source, while other shards may
    # still run - not by a step after every compute shard. Sources here span shards.
    src = _write(tmp_path / "in.parquet", _prompts(24))
    out = str(tmp_path / "out")
    spec = JobSpec(src, out, id_column="id", plan_window_rows=12)
    plan = plan_job(spec, llm=fake_llm, min_shards=3)
    copy_shards = [s for s in plan.shards if s.is_copy]
    compute = [s for s in plan.shards if not s.is_copy]
    assert len(copy_shards) == 2 and len(compute) == 3
    for copy in copy_shards:  # the plan names each copy shard's sources: its rows' shards
        rows_sources = shard_rows(load_shard(plan, copy)).sources
        assert set(copy.sources) == {s for _, s in rows_sources}
    assert max(len(c.sources) for c in copy_shards) >= 2
    prepare_output(plan)
    published: set[str] = set()
    written = []
    for shard in compute:
        run_shard(fake_llm, plan, shard)
        published.add(shard.shard_id)
        ready = copies_ready(plan, shard)
        # Ready exactly when this shard is a source and the last one to be published.
        assert [c.shard_id for c in ready] == [
            c.shard_id
            for c in copy_shards
            if shard.shard_id in c.sources and set(c.sources) <= published
        ]
        for copy in ready:
            assert not run_shard(None, plan, copy).skipped
            written.append(copy.shard_id)
    assert sorted(written) == sorted(c.shard_id for c in copy_shards)  # each once
    calls = sum(fake_llm.calls)
    ledger = run_job(src, out, llm=fake_llm, id_column="id", plan_window_rows=12)
    assert sum(fake_llm.calls) == calls and ledger.num_shards_run == 0
    results = read_results(out)
    assert sorted(results["id"].to_pylist()) == sorted(f"q{i}" for i in range(24))
    assert ledger.rows_deduplicated == 20  # rows 0, 1, 2 and 7 are computed
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist())
    assert ledger.completion_tokens == sum(results["completion_tokens"].to_pylist())


def test_openai_batch_output_keeps_input_order_with_copies(tmp_path, fake_llm):
    import json

    lines = []
    for i, prompt in enumerate(_prompts(8)):
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
        lines.append(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
        )
    src = tmp_path / "batch.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    ledger = run_job(
        str(src),
        str(out),
        llm=fake_llm,
        format="openai-batch",
        output_format="openai-batch",
        plan_window_rows=3,
    )
    assert ledger.rows_deduplicated == 4
    written = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [w["custom_id"] for w in written] == [f"c{i}" for i in range(8)]


def test_notebook_generate_computes_duplicates_once(fake_llm):
    from tokenmill.pipelines.notebook import generate

    frame = generate(_prompts(6), llm=fake_llm, max_tokens=4)
    assert sum(fake_llm.calls) == 3
    assert frame["duplicate_of"].to_list() == [None, None, None, *frame["id"].to_list()[:3]]
    assert frame["output"].to_list()[3:] == frame["output"].to_list()[:3]
    assert frame["completion_tokens"].to_list()[3:] == [0, 0, 0]
    plain = generate(_prompts(6), llm=fake_llm, max_tokens=4, dedupe=False)
    assert sum(fake_llm.calls) == 9 and "duplicate_of" not in plain.columns


def test_copies_get_the_answers_computing_each_row_gives(tmp_path, tiny_model_dir):
    """On the real engine (fp32): every row's answer with dedupe equals its answer when
    every row is computed, copies included - and the work saved is the copies' decode."""
    from tokenmill.engine.api.llm import LLM

    def llm():
        return LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20)

    prompts = [f"{QUESTIONS[i % 3]} ({i % 5})" for i in range(30)]
    src = _write(tmp_path / "in.parquet", prompts)
    once = run_job(src, str(tmp_path / "once"), llm=llm(), id_column="id", max_tokens=8)
    each = run_job(
        src, str(tmp_path / "each"), llm=llm(), id_column="id", max_tokens=8, dedupe=False
    )
    by_id = {r["id"]: r for r in read_results(str(tmp_path / "each")).to_pylist()}
    rows = read_results(str(tmp_path / "once")).to_pylist()
    assert once.rows_deduplicated == 15 and sum(r["duplicate_of"] is not None for r in rows) == 15
    for row in rows:
        assert (row["output"], row["finish_reason"]) == (
            by_id[row["id"]]["output"],
            by_id[row["id"]]["finish_reason"],
        )
    copied = [r for r in rows if r["duplicate_of"]]
    assert each.completion_tokens - once.completion_tokens == sum(
        by_id[r["id"]]["completion_tokens"] for r in copied
    )
