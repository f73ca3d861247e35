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
