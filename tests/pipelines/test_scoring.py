"""Scoring jobs (`task="score"`): each row's prompt log-probability sum and perplexity,
checked against the engine's own prompt log-probabilities and against transformers' loss
on the same tokens; error rows, the ledger, job identity, the CLI and `tokenmill.score`."""

from __future__ import annotations

import json
import math
import sys

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from child_jobs import kill_after_first_part, published_parts
from click.testing import CliRunner
from tiny_model import build_tiny_model

import tokenmill
from tokenmill.cli import main
from tokenmill.engine.api.llm import LLM
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.pipelines.job import JobSpec, plan_job, run_job
from tokenmill.pipelines.output import read_ledger_dataset, read_results
from tokenmill.pipelines.results import RESULT_SCHEMA, SCORE_RESULT_SCHEMA

ENGINE = {"kv_cache_memory": 8 << 20}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Translate to French: good morning, thank you, see you tomorrow.",
    "The quick brown fox jumps over the lazy cat, twice.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "user assistant system question answer prompt output",
    "Summarise the following text in one sentence: the fox jumps.",
]
# Rows that cannot be scored: a null, a one-token text (nothing after the first token to
# score), one longer than the tiny model's 256-token context.
BAD = {"null": None, "short": "a", "long": "fox " * 300}


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    """The tiny model with weights written by transformers (the reference loads them)."""
    return build_tiny_model(tmp_path_factory.mktemp("hf-tiny"), use_transformers=True, seed=3)


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    return LLM(str(hf_model_dir), dtype="float32", device="cpu", **ENGINE)


@pytest.fixture(scope="module")
def hf_model(hf_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()


def write_input(path, texts=TEXTS, bad=BAD):
    ids = [f"t{i}" for i in range(len(texts))] + list(bad)
    table = pa.table(
        {"id": ids, "text": list(texts) + list(bad.values()), "topic": list(range(len(ids)))}
    )
    pq.write_table(table, path)
    return str(path)


def test_a_scoring_job_gives_each_row_its_prompt_logprob_sum(tmp_path, llm, hf_model):
    src = write_input(tmp_path / "in.parquet")
    ledger = run_job(
        src,
        str(tmp_path / "out"),
        llm=llm,
        task="score",
        prompt_column="text",
        id_column="id",
        passthrough=["topic"],
        shard_tokens=40,  # several shards
        price_input=2.0,
        price_output=8.0,
    )
    results = read_results(str(tmp_path / "out"))
    assert results.schema.names == [*SCORE_RESULT_SCHEMA.names, "topic"]
    rows = {r["id"]: r for r in results.to_pylist()}
    assert set(rows) == {f"t{i}" for i in range(len(TEXTS))} | set(BAD)
    assert ledger.num_shards > 2 and ledger.task == "score"

    # Raw text, tokenized as the engine's own LLM.generate tokenizes a string.
    token_ids = llm.tokenizer.encode_batch(TEXTS)
    direct = llm.generate(token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    for i, (ids, out) in enumerate(zip(token_ids, direct)):
        row = rows[f"t{i}"]
        assert row["finish_reason"] == "score" and row["error"] is None
        assert row["output"] is None and row["completion_tokens"] == 0
        assert row["prompt_tokens"] == len(ids) and row["topic"] == i
        engine_sum = sum(entry[t] for entry, t in zip(out.prompt_logprobs[1:], ids[1:]))
        assert row["prompt_logprob_sum"] == pytest.approx(engine_sum, rel=1e-6)
        # transformers' mean loss over tokens 1..n-1 is -sum / (n - 1), on the same tokens
        with torch.no_grad():
            loss = hf_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
        assert -row["prompt_logprob_sum"] / (len(ids) - 1) == pytest.approx(loss, rel=1e-4)
        assert row["perplexity"] == pytest.approx(math.exp(loss), rel=1e-3)  # within 0.1%

    assert rows["null"]["error"] == "prompt is null"
    assert rows["short"]["error"].startswith("prompt encodes to 1 token(s), and scoring needs 2")
    assert "longer than the model's context of 256 tokens" in rows["long"]["error"]
    for name in BAD:
        assert rows[name]["finish_reason"] == "error" and rows[name]["prompt_tokens"] == 0
        assert rows[name]["perplexity"] is None and rows[name]["prompt_logprob_sum"] is None

    # The ledger: prompt tokens only, priced at the input price, equal to the rows' sums.
    num_prompt = sum(len(ids) for ids in token_ids)
    assert (ledger.rows_ok, ledger.rows_failed) == (len(TEXTS), len(BAD))
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist()) == num_prompt
    assert ledger.completion_tokens == 0 and ledger.cached_tokens == 0
    assert ledger.cost_output == 0.0
    assert ledger.cost_total == pytest.approx(num_prompt * 2.0 / 1e6)
    dataset = read_ledger_dataset(str(tmp_path / "out" / "ledger"))
    assert dataset["task"].to_pylist() == ["score"]
    assert dataset["prompt_tokens"].to_pylist() == [num_prompt]


def test_a_scoring_job_does_not_bill_the_cache_it_cannot_use(tmp_path, llm):
    """Rows sharing a long prefix: each is computed whole (its scores need every token's
    logits), and billed whole at the input price."""
    prefix = "Summarise the following text in one sentence: "
    texts = [prefix + t for t in TEXTS[:4]]
    src = write_input(tmp_path / "in.parquet", texts, bad={})
    ledger = run_job(src, str(tmp_path / "out"), llm=llm, task="score", prompt_column="text")
    results = read_results(str(tmp_path / "out"))
    assert results["cached_tokens"].to_pylist() == [0] * 4
    assert ledger.prompt_tokens == sum(len(ids) for ids in llm.tokenizer.encode_batch(texts))


def test_scoring_and_generation_are_different_jobs(tmp_path, llm):
    src = write_input(tmp_path / "in.parquet")
    common = dict(prompt_column="text", id_column="id", raw=True)
    out = str(tmp_path / "out")
    shards = {
        task: plan_job(JobSpec(src, out, task=task, **common), llm=llm).shards
        for task in ("generate", "score")
    }
    generated_ids = {s.shard_id for s in shards["generate"]}
    assert not generated_ids & {s.shard_id for s in shards["score"]}

    run_job(src, out, llm=llm, max_tokens=2, **common)
    with pytest.raises(ValueError, match="part\\(s\\) that are not shards of this job"):
        run_job(src, out, llm=llm, task="score", **common)
    ledger = run_job(src, out, llm=llm, task="score", resume=False, **common)
    assert ledger.task == "score" and ledger.completion_tokens == 0
    assert read_results(out).schema.names[: len(SCORE_RESULT_SCHEMA)] == SCORE_RESULT_SCHEMA.names


def test_text_is_scored_raw_unless_chat_is_asked_for(tmp_path, llm):
    """Raw by default; --chat renders a user message, without the generation prompt."""
    text = TEXTS[0]
    scored = tokenmill.score([text], llm=llm)
    assert scored["prompt_tokens"].to_list() == [len(llm.tokenizer.encode_batch([text])[0])]
    chat = tokenmill.score([text], llm=llm, raw=False)
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=False
    )
    assert rendered.endswith("<|im_end|>\n")
    ids = llm.tokenizer.encode_batch([rendered], add_special_tokens=False)[0]
    assert chat["prompt_tokens"].to_list() == [len(ids)]
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    expected = sum(e[t] for e, t in zip(out.prompt_logprobs[1:], ids[1:]))
    assert chat["prompt_logprob_sum"].to_list() == [pytest.approx(expected, rel=1e-6)]
    # A messages column: the conversation as given, assistant turn included.
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    frame = pl.DataFrame({"messages": [messages]})
    conversation = tokenmill.score(frame, llm=llm, messages_column="messages")
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    ids = llm.tokenizer.encode_batch([rendered], add_special_tokens=False)[0]
    assert conversation["prompt_tokens"].to_list() == [len(ids)]


def test_score_on_a_polars_dataframe_keeps_input_order(tmp_path, llm):
    frame = pl.DataFrame(
        {"text": [TEXTS[3], None, TEXTS[0], TEXTS[5]], "label": ["d", "null", "a", "f"]}
    )
    scored = tokenmill.score(frame, llm=llm, prompt_column="text")
    assert scored.columns == [*SCORE_RESULT_SCHEMA.names, "text", "label"]
    assert scored["label"].to_list() == ["d", "null", "a", "f"]
    assert scored["finish_reason"].to_list() == ["score", "error", "score", "score"]
    # The same rows as a scoring job scores them.
    src = write_input(tmp_path / "in.parquet", [TEXTS[3], TEXTS[0], TEXTS[5]], bad={})
    run_job(src, str(tmp_path / "out"), llm=llm, task="score", prompt_column="text")
    job = read_results(str(tmp_path / "out")).sort_by("id")["prompt_logprob_sum"].to_pylist()
    ours = scored["prompt_logprob_sum"].to_list()
    assert [ours[0], ours[2], ours[3]] == pytest.approx(job, rel=1e-6)


def test_the_cli_scores_a_jsonl_file(tmp_path, hf_model_dir):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS[:3]))
    out = tmp_path / "out"
    args = ["run", str(src), str(out), "--task", "score", "--model", str(hf_model_dir)]
    args += ["--dtype", "float32", "--engine-option", "kv_cache_memory=8388608"]
    result = CliRunner().invoke(main, [*args, "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    ledger = json.loads(result.output)
    results = read_results(str(out))
    assert ledger["task"] == "score" and ledger["rows_ok"] == 3
    assert ledger["completion_tokens"] == 0
    assert ledger["prompt_tokens"] == sum(results["prompt_tokens"].to_pylist())
    assert all(p > 1 for p in results["perplexity"].to_pylist())
    bad = CliRunner().invoke(main, [*args, "--max-tokens", "5"])
    assert bad.exit_code != 0
    assert "max_tokens: a scoring job generates nothing" in bad.output


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_tokens=8, temperature=0.7), "max_tokens, temperature: a scoring job generates"),
        (dict(system="Be brief."), "add --chat \\(raw=False\\) to score the text"),
        (dict(output_format="openai-batch"), "a scoring job completes nothing"),
        (dict(format="openai-batch"), "an OpenAI batch file holds generation requests"),
        (dict(passthrough=["perplexity"]), "clash with result columns"),
        (dict(json_schema={"type": "object"}), "json_schema: a scoring job generates nothing"),
        (dict(choice=["a", "b"]), "choice: a scoring job generates nothing"),
        (dict(json_schema_column="schema"), "json_schema_column: a scoring job generates"),
        (dict(passthrough=["structured_output_complete"]), "clash with result columns"),
    ],
)
def test_options_a_scoring_job_refuses(options, message):
    with pytest.raises(ValueError, match=message):
        JobSpec("in.parquet", "out", task="score", **options)


def test_a_generation_job_may_pass_a_perplexity_column_through():
    assert JobSpec("in.parquet", "out", passthrough=["perplexity"]).passthrough == ("perplexity",)
    assert JobSpec("in.parquet", "out", task="score", system="S", raw=False).raw is False


def test_tokenmill_score_takes_no_sampling_option(llm):
    with pytest.raises(ValueError, match="max_tokens: a scoring job generates nothing"):
        tokenmill.score(["some text"], llm=llm, max_tokens=4)
    with pytest.raises(TypeError, match="unknown option 'task'"):
        tokenmill.score(["some text"], llm=llm, task="generate")


def test_generation_results_keep_their_schema(tmp_path, llm):
    answered = tokenmill.generate([TEXTS[0]], llm=llm, max_tokens=2)
    assert answered.columns == [*RESULT_SCHEMA.names, "prompt"]


# A scoring job in a child process, slowed after each shard so it can be killed midway.
CHILD = """
import sys, time
from tokenmill.engine.api.llm import LLM
from tokenmill.pipelines.job import run_job

generate = LLM.generate
LLM.generate = lambda self, *a, **k: (generate(self, *a, **k), time.sleep(0.4))[0]
src, out, model = sys.argv[1:4]
run_job(src, out, model=model, task="score", prompt_column="text", id_column="id",
        shard_tokens=40, dtype="float32", engine_options={"kv_cache_memory": 8 << 20})
"""


def test_a_killed_scoring_job_resumes(tmp_path, hf_model_dir):
    src = write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    kill_after_first_part(
        [sys.executable, str(script), src, str(out), str(hf_model_dir)], out / "results"
    )
    before = published_parts(out / "results")

    ledger = run_job(
        src,
        str(out),
        model=str(hf_model_dir),
        task="score",
        prompt_column="text",
        id_column="id",
        shard_tokens=40,
        dtype="float32",
        engine_options=ENGINE,
    )
    after = published_parts(out / "results")
    assert all(after[name] == mtime for name, mtime in before.items())  # not recomputed
    assert 0 < ledger.num_shards_run == ledger.num_shards - len(before)
    results = read_results(str(out))
    assert sorted(results["id"].to_pylist()) == sorted(
        [f"t{i}" for i in range(len(TEXTS))] + list(BAD)
    )
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist())
    assert (ledger.rows_ok, ledger.rows_failed, ledger.task) == (len(TEXTS), len(BAD), "score")
