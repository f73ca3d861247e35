"""One prompt rule on every surface, with the real engine on tiny models: through the chat
template when the model has one, as it is with `raw`, as it is on a model without one."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from tiny_model import build_tiny_model

import tokenmill
from tokenmill.cli import main
from tokenmill.engine.api.describe import describe_model
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.pipelines import notebook
from tokenmill.pipelines.output import read_results

PROMPTS = ["What is the capital of France?", "Say hi."]
SYSTEM = "Be brief."
ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 8 << 20}}


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """The tiny model without a chat template, as a base model ships."""
    return build_tiny_model(tmp_path_factory.mktemp("base"), chat_template=None)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), path)
    return str(path)


def chat_lengths(model_dir, system=None) -> list[int]:
    """Prompt tokens of each prompt sent as a user message through the chat template."""
    tokenizer = Tokenizer.from_dir(model_dir)
    head = [{"role": "system", "content": system}] if system else []
    texts = [
        tokenizer.apply_chat_template([*head, {"role": "user", "content": p}]) for p in PROMPTS
    ]
    return [len(ids) for ids in tokenizer.encode_batch(texts, add_special_tokens=False)]


def raw_lengths(model_dir) -> list[int]:
    return [len(ids) for ids in Tokenizer.from_dir(model_dir).encode_batch(PROMPTS)]


def job_lengths(data, output, model_dir, **options) -> list[int]:
    tokenmill.run_job(data, str(output), model=str(model_dir), max_tokens=2, **ENGINE, **options)
    return read_results(str(output)).sort_by("id")["prompt_tokens"].to_pylist()


def notebook_lengths(model_dir, **options) -> list[int]:
    results = tokenmill.generate(PROMPTS, model=str(model_dir), max_tokens=2, **ENGINE, **options)
    return results["prompt_tokens"].to_list()


def test_the_description_says_whether_there_is_a_template(tiny_model_dir, base_model_dir):
    assert describe_model(tiny_model_dir).has_chat_template
    base = describe_model(base_model_dir)
    assert base.chat_template is None and not base.has_chat_template


def test_chat_template_by_default_raw_on_request(tmp_path, data, tiny_model_dir):
    chat, raw = chat_lengths(tiny_model_dir), raw_lengths(tiny_model_dir)
    assert chat != raw  # the comparison below could tell the two apart
    assert job_lengths(data, tmp_path / "chat", tiny_model_dir) == chat
    assert notebook_lengths(tiny_model_dir) == chat
    assert job_lengths(data, tmp_path / "raw", tiny_model_dir, raw=True) == raw
    assert notebook_lengths(tiny_model_dir, raw=True) == raw
    with_system = chat_lengths(tiny_model_dir, system=SYSTEM)
    assert job_lengths(data, tmp_path / "sys", tiny_model_dir, system=SYSTEM) == with_system
    assert notebook_lengths(tiny_model_dir, system=SYSTEM) == with_system


def test_a_model_without_a_chat_template_runs_raw(tmp_path, data, base_model_dir):
    raw = raw_lengths(base_model_dir)
    assert job_lengths(data, tmp_path / "out", base_model_dir) == raw
    assert notebook_lengths(base_model_dir) == raw


def test_a_system_prompt_for_a_model_without_a_template_fails_before_compute(
    tmp_path, data, base_model_dir
):
    with pytest.raises(ValueError, match="no chat template, so a system prompt cannot be sent"):
        tokenmill.run_job(data, str(tmp_path / "out"), model=str(base_model_dir), system=SYSTEM)
    assert not (tmp_path / "out" / "results").exists()


def test_raw_and_a_system_prompt_do_not_go_together(tmp_path, data):
    with pytest.raises(ValueError, match="give one of system and raw"):
        tokenmill.run_job(data, str(tmp_path / "out"), system=SYSTEM, raw=True)


def test_the_cli_commands_follow_the_same_rule(tmp_path, data, tiny_model_dir, monkeypatch):
    engine = ["--dtype", "float32", "--engine-option", f"kv_cache_memory={8 << 20}"]
    model = ["--model", str(tiny_model_dir), "--max-tokens", "2", *engine]
    answered = []

    def recording_generate(*args, **kwargs):  # `tokenmill generate` answers through this
        results = notebook_generate(*args, **kwargs)
        answered.append(results["prompt_tokens"].to_list())
        return results

    notebook_generate = notebook.generate
    monkeypatch.setattr(notebook, "generate", recording_generate)
    chat, raw = chat_lengths(tiny_model_dir), raw_lengths(tiny_model_dir)
    for flags, expected in (([], chat), (["--chat"], chat), (["--raw"], raw)):
        out = tmp_path / f"out{len(answered)}"
        args = ["run", data, str(out), "--no-progress", *model, *flags]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert read_results(str(out)).sort_by("id")["prompt_tokens"].to_pylist() == expected
        shown = CliRunner().invoke(main, ["generate", *PROMPTS, *model, *flags])
        assert shown.exit_code == 0 and shown.output.count("\n> ") + 1 == len(PROMPTS)
        assert answered[-1] == expected
