"""`tokenmill generate` end to end on a tiny random model."""

from __future__ import annotations

from click.testing import CliRunner
from tiny_model import build_tiny_model

from tokenmill.cli import main


def test_generate_prints_one_answer_per_prompt(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "hello there",
            "the quick brown fox",
            "--model",
            str(model),
            "--raw",
            "--max-tokens",
            "4",
            "--dtype",
            "float32",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines.count("> hello there") == 1 and lines.count("> the quick brown fox") == 1
    answer = lines[lines.index("> hello there") + 1]
    assert answer and not answer.startswith("[error]")


def test_a_base_model_without_chat_template_gets_its_prompts_as_they_are(tmp_path):
    import json

    from tokenmill.engine.api.llm import LLM
    from tokenmill.engine.types.sampling_params import SamplingParams

    model = build_tiny_model(tmp_path / "base")
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    args = ["generate", "the quick brown fox", "--model", str(model), "--max-tokens", "4"]
    result = CliRunner().invoke(main, [*args, "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    raw = LLM(model, dtype="float32").generate(
        ["the quick brown fox"], SamplingParams(max_tokens=4, temperature=0)
    )
    assert result.output.splitlines()[1] == raw[0].text.strip()
