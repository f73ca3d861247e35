"""OpenAI batch files with /v1/embeddings lines: each line answered in the
CreateEmbeddingResponse shape (validated by the `openai` package's own types), one line
with several inputs, `dimensions`, base64, and chat lines beside them - answered by a
model that serves both, error lines naming why on one that does not."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from pooling_models import build_sentence_encoder, write_sentence_transformers_files
from tiny_model import build_tiny_model

from tokenmill.engine.api.llm import LLM
from tokenmill.pipelines.job import run_job

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    line("e1", "/v1/embeddings", {"model": "m", "input": "the quick brown fox"}),
    line(
        "e2",
        "/v1/embeddings",
        {"model": "m", "input": ["first text", "second", "third one"], "dimensions": 16},
    ),
    line(
        "c1",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    ),
    line(
        "e3", "/v1/embeddings", {"input": "base64 please", "encoding_format": "base64", "user": "u"}
    ),
    line("e4", "/v1/embeddings", {"input": ["fine", ""]}),
    line("e5", "/v1/embeddings", {"input": "x", "dimensions": 4096}),
    line("e6", "/v1/embeddings", {"input": "x", "temperature": 0.5}),
]


def run_file(tmp_path, llm) -> dict[str, dict]:
    src = tmp_path / "batch.jsonl"
    src.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "out"
    ledger = run_job(
        str(src),
        str(out),
        format="openai-batch",
        output_format="openai-batch",
        llm=llm,
        plan_window_rows=2,  # e2's three inputs fall in two planning windows
        shard_tokens=8,
    )
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [
        f"e{i}" if i else "c1" for i in (1, 2, 0, 3, 4, 5, 6)
    ]
    return {x["custom_id"]: x for x in lines}, ledger


def embedding_body(answer: dict):
    body = answer["response"]["body"]
    for item in body["data"]:  # the SDK decodes base64 itself before validating
        if isinstance(item["embedding"], str):
            item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), "<f4").tolist()
    return openai_types.CreateEmbeddingResponse.model_validate(body)


def test_embedding_lines_beside_chat_lines_on_a_model_that_serves_both(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    write_sentence_transformers_files(model, pooling_mode="lasttoken", normalize=True)
    llm = LLM(str(model), dtype="float32")
    answers, ledger = run_file(tmp_path, llm)

    e1 = embedding_body(answers["e1"])
    want = llm.embed("the quick brown fox")[0]
    np.testing.assert_allclose(e1.data[0].embedding, want.embedding, atol=1e-6)
    assert e1.usage.prompt_tokens == e1.usage.total_tokens == want.prompt_tokens

    e2 = embedding_body(answers["e2"])
    assert [d.index for d in e2.data] == [0, 1, 2]
    for item, text in zip(e2.data, ["first text", "second", "third one"]):
        np.testing.assert_allclose(
            item.embedding, llm.embed(text, dimensions=16)[0].embedding, atol=1e-6
        )
    assert e2.usage.prompt_tokens == sum(
        len(llm.tokenizer.encode(t)) for t in ["first text", "second", "third one"]
    )

    assert isinstance(answers["e3"]["response"]["body"]["data"][0]["embedding"], str)
    e3 = embedding_body(answers["e3"])
    np.testing.assert_allclose(
        e3.data[0].embedding, llm.embed("base64 please")[0].embedding, atol=1e-6
    )

    chat = chat_types.ChatCompletion.model_validate(answers["c1"]["response"]["body"])
    assert chat.usage.completion_tokens <= 3

    assert answers["e4"]["error"]["message"] == "input 1: prompt is empty"
    assert "dimensions=4096 is more than the model's 64" in answers["e5"]["error"]["message"]
    assert (
        "body.temperature is not supported for /v1/embeddings" in answers["e6"]["error"]["message"]
    )
    assert ledger.rows_failed == 3 and ledger.rows_ok == 7  # inputs, not lines


def test_chat_lines_are_error_lines_on_an_embedding_model(tmp_path):
    build_sentence_encoder(tmp_path / "model")
    llm = LLM(str(tmp_path / "model"), dtype="float32")
    answers, _ = run_file(tmp_path, llm)
    embedding_body(answers["e2"])
    message = answers["c1"]["error"]["message"]
    assert "does not serve /v1/chat/completions (it serves embed)" in message
