"""A job over JSON rows whose messages and passthrough objects gain keys past the file's
head: `tokenmill run` prompts each row with every message key it has (its tool calls
rendered by the chat template) and writes each passthrough object back whole - from
JSON Lines and from a JSON array alike."""

from __future__ import annotations

import json

import jinja2
import pytest
from click.testing import CliRunner
from tiny_model import build_tiny_model
from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.cli import main
from tokenmill.pipelines.output import read_results

ENGINE = ["--engine-option", f"kv_cache_memory={8 << 20}", "--dtype", "float32"]

# ChatML that renders tool calls, the id of the call a tool answers, and a call's id
# only where the call has one (a null id would render "[None]").
TOOLS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }}"
    "{% if call.id is defined %}[{{ call.id }}]{% endif %}"
    "({{ call.function.arguments }})</tool_call>{% endfor %}"
    "{% if message.tool_call_id %} for {{ message.tool_call_id }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAD = "p" * 100_000  # rows of ~100 KB: the 1 MiB head holds the first ten
NUM_ROWS, HEAD_ROWS = 12, 10
LATE = [
    {"role": "user", "content": "Weather in Oslo?", "name": "ann"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
    {"role": "user", "content": "Thanks!"},
]
# A late row whose tool call has an id: the other's is null in the column's struct.
LATE_WITH_ID = [
    LATE[0],
    {**LATE[1], "tool_calls": [{**LATE[1]["tool_calls"][0], "id": "call_1"}]},
    *LATE[2:],
]


def _rows() -> list[dict]:
    rows = []
    for i in range(NUM_ROWS):
        # Distinct early rows: none is answered as a copy of another (zero tokens).
        early = [{"role": "user", "content": f"Name colour {i}."}]
        messages = early if i < HEAD_ROWS else (LATE if i == HEAD_ROWS else LATE_WITH_ID)
        meta = {"source": "web"} if i < HEAD_ROWS else {"source": "web", "reviewer": f"r{i}"}
        rows.append({"id": f"q{i}", "messages": messages, "meta": meta, "pad": PAD})
    return rows


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _reference_tokens(model_dir, messages: list[dict]) -> int:
    """The prompt's token count: the template rendered by plain jinja2 over the messages
    as the file holds them (name aside: tokenmill hands a template role, content, tool
    calls and tool_call_id), encoded by the model's tokenizer."""
    kept = [{k: v for k, v in m.items() if k != "name"} for m in messages]
    text = (
        jinja2.Environment()
        .from_string(TOOLS_TEMPLATE)
        .render(messages=kept, add_generation_prompt=True)
    )
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(backend.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-tools"),
        chat_template=TOOLS_TEMPLATE,
        max_position_embeddings=512,
    )


@pytest.mark.parametrize("shape", ["jsonl", "json-array"])
def test_run_prompts_and_passes_through_every_late_key(tmp_path, tools_model_dir, shape):
    rows = _rows()
    if shape == "jsonl":
        source = tmp_path / "in.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        source = tmp_path / "in.json"
        source.write_text(json.dumps(rows, indent=1))
    out = tmp_path / "out"

    result = CliRunner().invoke(
        main,
        [
            "run",
            str(source),
            str(out),
            "--model",
            str(tools_model_dir),
            "--messages-column",
            "messages",
            "--id-column",
            "id",
            "--passthrough",
            "meta",
            "--passthrough",
            "messages",
            "--max-tokens",
            "1",
            "--no-progress",
            *ENGINE,
        ],
        catch_exceptions=False,
    )

    assert result.exit_code == 0, result.output
    results = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert sorted(results) == sorted(r["id"] for r in rows)
    for row in rows:
        got = results[row["id"]]
        assert got["error"] is None
        assert _without_nulls(got["meta"]) == row["meta"]
        assert _without_nulls(got["messages"]) == _without_nulls(row["messages"])
        assert got["prompt_tokens"] == _reference_tokens(tools_model_dir, row["messages"])
    # The tool calls are in the prompt: without them it would be shorter; an id the
    # row has is rendered, one it lacks is not.
    no_calls = [{k: v for k, v in m.items() if k != "tool_calls"} for m in LATE]
    assert results["q10"]["prompt_tokens"] > _reference_tokens(tools_model_dir, no_calls)
    assert results["q11"]["prompt_tokens"] > results["q10"]["prompt_tokens"]
    assert results["q11"]["messages"][0]["name"] == "ann"
