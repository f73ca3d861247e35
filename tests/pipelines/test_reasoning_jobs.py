"""Chat jobs over models that write their reasoning apart: the `reasoning_content`
result column equals `LLM.chat`'s split of the same rows (a choice constraint fixes the
answer), raw jobs and plain templates split nothing, and n > 1 is refused by name."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from tiny_model import build_tiny_model

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.structured_outputs import StructuredOutputs
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import (
    completed_shards,
    read_ledger,
    read_results,
    read_shard_stats,
)

THINK_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# <think></think> #}"
HARMONY_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{{ reasoning_effort | default('medium') }}{# <|channel|> #}"
)
THINK_ANSWER = "<think>two plus two</think>four"
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>four"
)
PROMPTS = ["hi", "what is 2+2?"]


def job_rows(tmp_path, template: str, answer: str, **options) -> tuple[LLM, dict]:
    model = tmp_path / "model"
    build_tiny_model(model, chat_template=template)
    src = tmp_path / "in.csv"
    src.write_text("id,prompt\n" + "".join(f'{i},"{p}"\n' for i, p in enumerate(PROMPTS)))
    llm = LLM(str(model), dtype="float32")
    out = tmp_path / "out"
    opts = {
        "choice": [answer],
        "max_tokens": len(answer) + 2,
        "temperature": 0,
        "id_column": "id",
        **options,
    }
    run_job(str(src), str(out), llm=llm, **opts)
    return llm, {r["id"]: r for r in read_results(str(out)).to_pylist()}


def chat_completions(llm: LLM, answer: str) -> list:
    params = SamplingParams(
        temperature=0,
        max_tokens=len(answer) + 2,
        structured_outputs=StructuredOutputs(choice=[answer]),
    )
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [o.outputs[0] for o in outputs]


def chat_split(llm: LLM, answer: str) -> list[tuple[str | None, str]]:
    return [(c.reasoning_content, c.text) for c in chat_completions(llm, answer)]


def tokens_inside(llm: LLM, answer: str, reasoning: str, token_ids: list[int]) -> int:
    """The answer's tokens whose text begins inside its (only) `reasoning`, each token's
    start the length of everything decoded before it."""
    ids = [t for t in token_ids if t not in llm.tokenizer.eos_token_ids]
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == answer
    start = answer.index(reasoning)
    starts = [
        len(llm.tokenizer.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))
    ]
    return sum(start <= s < start + len(reasoning) for s in starts)


@pytest.mark.parametrize(
    ("template", "answer", "split"),
    [
        (THINK_TEMPLATE, THINK_ANSWER, ("two plus two", "four")),
        (HARMONY_TEMPLATE, HARMONY_ANSWER, ("easy", "four")),
    ],
    ids=["think", "harmony"],
)
def test_a_chat_job_splits_as_llm_chat_does(tmp_path, template, answer, split):
    llm, rows = job_rows(tmp_path, template, answer)
    got = [rows[str(i)] for i in range(len(PROMPTS))]
    chats = chat_completions(llm, answer)
    assert [(r["reasoning_content"], r["output"]) for r in got] == [split] * len(PROMPTS)
    assert [(c.reasoning_content, c.text) for c in chats] == [split] * len(PROMPTS)
    assert all(r["error"] is None and r["finish_reason"] == "stop" for r in rows.values())
    # reasoning_tokens: the split's count, the tokens that begin inside the reasoning
    counts = [tokens_inside(llm, answer, split[0], c.token_ids) for c in chats]
    assert 0 < counts[0] < got[0]["completion_tokens"]
    assert [r["reasoning_tokens"] for r in got] == [c.reasoning_tokens for c in chats] == counts
    # the ledger's and the shards' sums are the rows'
    ledger = read_ledger(str(tmp_path / "out"))
    assert ledger.reasoning_tokens == sum(counts) > 0
    assert ledger.completion_tokens == sum(r["completion_tokens"] for r in got)
    stats = read_shard_stats(str(tmp_path / "out"), completed_shards(str(tmp_path / "out")))
    assert sum(s.reasoning_tokens for s in stats) == sum(counts)


@pytest.mark.parametrize(
    ("template", "answer"),
    [(THINK_TEMPLATE, THINK_ANSWER), (HARMONY_TEMPLATE, HARMONY_ANSWER)],
    ids=["think", "harmony"],
)
def test_a_notebook_splits_as_a_job_does(tmp_path, template, answer):
    import polars as pl

    import tokenmill

    llm, rows = job_rows(tmp_path, template, answer)
    frame = tokenmill.generate(
        pl.DataFrame({"id": [str(i) for i in range(len(PROMPTS))], "prompt": PROMPTS}),
        llm=llm,
        id_column="id",
        choice=[answer],
        max_tokens=len(answer) + 2,
        temperature=0,
    )
    got = frame.select("id", "reasoning_content", "output").rows()
    assert got == [(i, rows[i]["reasoning_content"], rows[i]["output"]) for i in rows]
    assert [o for _, _, o in got] == ["four"] * len(PROMPTS)
    with pytest.raises(ValueError, match="n > 1 is not supported yet"):
        tokenmill.generate(PROMPTS, llm=llm, n=2, temperature=1.0)


def test_a_raw_job_and_a_plain_template_split_nothing(tmp_path):
    _, rows = job_rows(tmp_path / "raw", THINK_TEMPLATE, THINK_ANSWER, raw=True)
    assert [r["output"] for r in rows.values()] == [THINK_ANSWER] * len(PROMPTS)
    assert "reasoning_content" not in next(iter(rows.values()))
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    _, rows = job_rows(tmp_path / "plain", plain, THINK_ANSWER)
    assert [r["output"] for r in rows.values()] == [THINK_ANSWER] * len(PROMPTS)
    assert "reasoning_content" not in next(iter(rows.values()))


def test_several_completions_are_refused_for_a_reasoning_model(tmp_path):
    refused = "n > 1 is not supported yet for a model that writes"
    with pytest.raises(ValueError, match=refused):
        job_rows(tmp_path, THINK_TEMPLATE, THINK_ANSWER, n=2, temperature=1.0)
    # An OpenAI batch line's own n: that line's error row, the other lines answered.
    model = tmp_path / "model"
    src = tmp_path / "batch.jsonl"
    messages = [{"role": "user", "content": "hi"}]
    several = batch_line("two", "/v1/chat/completions", messages=messages)
    several["body"].update(n=2, temperature=1.0)
    one = batch_line("one", "/v1/chat/completions", messages=messages)
    src.write_text("".join(json.dumps(line) + "\n" for line in (several, one)))
    llm = LLM(str(model), dtype="float32")
    out = tmp_path / "out2"
    run_job(str(src), str(out), llm=llm, format="openai-batch", id_column="custom_id")
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert rows["two"]["finish_reason"] == "error" and refused in rows["two"]["error"]
    assert "n=2" in rows["two"]["error"]
    assert rows["one"]["error"] is None and rows["one"]["finish_reason"] in ("stop", "length")


def batch_line(custom_id: str, url: str, **body) -> dict:
    budget = "max_output_tokens" if url == "/v1/responses" else "max_tokens"
    body = {"model": "m", budget: len(THINK_ANSWER) + 2, "temperature": 0, **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_batch_lines_carry_reasoning_as_vllm_does(tmp_path):
    model = tmp_path / "model"
    build_tiny_model(model, chat_template=THINK_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    lines = [
        batch_line("chat", "/v1/chat/completions", messages=messages),
        batch_line("raw", "/v1/completions", prompt="hi"),
        batch_line("resp", "/v1/responses", input="hi"),
        batch_line("resp2", "/v1/responses", input="what is 2+2?"),  # not a copy: billed
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    llm = LLM(str(model), dtype="float32")
    opts = {"format": "openai-batch", "output_format": "openai-batch", "choice": [THINK_ANSWER]}
    run_job(str(src), str(out), llm=llm, **opts)
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert [r["error"] for r in rows.values()] == [None] * 4
    assert rows["resp"]["duplicate_of"] == "chat"
    assert (rows["chat"]["reasoning_content"], rows["chat"]["output"]) == ("two plus two", "four")
    assert (rows["raw"]["reasoning_content"], rows["raw"]["output"]) == (None, THINK_ANSWER)
    (chat_completion,) = chat_completions(llm, THINK_ANSWER)[:1]
    reasoning_tokens = rows["chat"]["reasoning_tokens"]
    assert reasoning_tokens == chat_completion.reasoning_tokens > 0
    # a raw line splits nothing; a copy bills no tokens, its reasoning's included
    assert [rows[i]["reasoning_tokens"] for i in ("raw", "resp", "resp2")] == [
        0,
        0,
        reasoning_tokens,
    ]
    assert rows["resp"]["completion_tokens"] == 0
    assert read_ledger(str(out)).reasoning_tokens == 2 * reasoning_tokens
    written = {
        w["custom_id"]: w["response"]["body"]
        for w in map(json.loads, (out / "results.jsonl").read_text().splitlines())
    }
    chat = ChatCompletion.model_validate(written["chat"])
    message = chat.choices[0].message
    assert (message.content, message.reasoning_content) == ("four", "two plus two")
    assert chat.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert Completion.model_validate(written["raw"]).choices[0].text == THINK_ANSWER
    response = Response.model_validate(written["resp"])
    reasoning, answer = response.output
    assert reasoning.type == "reasoning"
    assert [c.text for c in reasoning.content] == ["two plus two"]
    assert response.output_text == "four"
    billed = Response.model_validate(written["resp2"]).usage
    assert billed.output_tokens_details.reasoning_tokens == reasoning_tokens
    assert billed.output_tokens == rows["chat"]["completion_tokens"] > reasoning_tokens


def chat_prompt_tokens(llm: LLM, **chat_args) -> int:
    params = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat([{"role": "user", "content": PROMPTS[0]}], params, **chat_args)[0]
    return len(out.prompt_token_ids)


def test_reasoning_effort_as_a_job_option_reaches_the_chat_template(tmp_path):
    llm, rows = job_rows(tmp_path, HARMONY_TEMPLATE, HARMONY_ANSWER, reasoning_effort="high")
    high = chat_prompt_tokens(llm, reasoning_effort="high")
    assert high != chat_prompt_tokens(llm)  # "medium" by default: another prompt
    assert rows["0"]["prompt_tokens"] == high
    assert (rows["0"]["reasoning_content"], rows["0"]["output"]) == ("easy", "four")


def test_reasoning_effort_is_refused_before_compute_where_it_cannot_go(tmp_path):
    with pytest.raises(ValueError, match="chat template does not read it"):
        job_rows(tmp_path / "think", THINK_TEMPLATE, THINK_ANSWER, reasoning_effort="low")
    with pytest.raises(ValueError, match="give one of reasoning_effort and raw"):
        job_rows(
            tmp_path / "raw", HARMONY_TEMPLATE, HARMONY_ANSWER, reasoning_effort="low", raw=True
        )
    with pytest.raises(ValueError, match="reasoning_effort"):
        job_rows(tmp_path / "bad", HARMONY_TEMPLATE, HARMONY_ANSWER, reasoning_effort="max")


def test_a_batch_line_reasoning_effort_is_honoured_or_its_row_refused(tmp_path):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    lines = [
        batch_line("high", "/v1/chat/completions", messages=messages, reasoning_effort="high"),
        batch_line("max", "/v1/chat/completions", messages=messages, reasoning_effort="max"),
    ]
    results = {}
    for name, template, answer in [
        ("harmony", HARMONY_TEMPLATE, HARMONY_ANSWER),
        ("think", THINK_TEMPLATE, THINK_ANSWER),
    ]:
        model = tmp_path / name / "model"
        build_tiny_model(model, chat_template=template)
        src = tmp_path / name / "batch.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in lines))
        llm = LLM(str(model), dtype="float32")
        out = tmp_path / name / "out"
        run_job(str(src), str(out), llm=llm, format="openai-batch", choice=[answer])
        results[name] = {r["id"]: r for r in read_results(str(out)).to_pylist()}
        if name == "harmony":
            high = chat_prompt_tokens(llm, reasoning_effort="high")
    harmony, think = results["harmony"], results["think"]
    assert harmony["high"]["error"] is None and harmony["high"]["prompt_tokens"] == high
    assert "reasoning_effort must be one of low, medium, high, not 'max'" in harmony["max"]["error"]
    assert "chat template does not read it" in think["high"]["error"]
