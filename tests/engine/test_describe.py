"""`describe_model`, and the one weight-file lister: the weights hash covers exactly the
files that load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model

from tokenmill.engine.api.describe import describe_model
from tokenmill.engine.loader import model_files, weights
from tokenmill.engine.loader.model_files import (
    DEFAULT_MODEL,
    ModelFilesError,
    display_name,
    weight_files,
    weights_hash,
)
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import load_config

INDEX = "model.safetensors.index.json"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def sharded(tmp_path):
    """The tiny model with its weights in two shards and an index, plus a stray
    `consolidated.safetensors` that no index names (as some Hub repos ship)."""
    path = build_tiny_model(tmp_path / "sharded")
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(path / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    save_file({"x": torch.zeros(2)}, str(path / "consolidated.safetensors"))
    return path


def loaded_and_hashed(path, monkeypatch) -> tuple[list[str], list[str]]:
    """The files `load_model` opens and the files `weights_hash` reads, by name."""
    opened, hashed = [], []
    real_open, real_sha = weights.iter_tensors, model_files.file_sha256

    def recording_open(file, *args, **kwargs):
        opened.append(str(file).rsplit("/", 1)[-1])
        return real_open(file, *args, **kwargs)

    def recording_sha(file, **kwargs):
        hashed.append(str(file).rsplit("/", 1)[-1])
        return real_sha(file, **kwargs)

    monkeypatch.setattr(weights, "iter_tensors", recording_open)
    monkeypatch.setattr(model_files, "file_sha256", recording_sha)
    config = load_config(path)
    weights.load_model(path, config, dtype=torch.float32, device=torch.device("cpu"))
    weights_hash(path)
    return opened, hashed


def test_the_hash_covers_exactly_the_loaded_files(sharded, monkeypatch):
    opened, hashed = loaded_and_hashed(sharded, monkeypatch)
    listed = [f.name for f in weight_files(sharded)]
    assert listed == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert opened == hashed == listed


def test_a_single_file_model_loads_and_hashes_only_it(tmp_path, monkeypatch):
    path = build_tiny_model(tmp_path / "single")
    shutil.copy(path / "model.safetensors", path / "adapter.safetensors")
    opened, hashed = loaded_and_hashed(path, monkeypatch)
    assert opened == hashed == ["model.safetensors"]


def test_weights_under_another_name_neither_load_nor_hash(tmp_path):
    # Loading used to fall back to any *.safetensors while hashing did not.
    path = build_tiny_model(tmp_path / "renamed")
    (path / "model.safetensors").rename(path / "weights.safetensors")
    config = load_config(path)
    with pytest.raises(ModelFilesError, match=r"model\.safetensors or model\.safetensors\.index"):
        weights.load_model(path, config, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ModelFilesError, match=r"model\.safetensors or model\.safetensors\.index"):
        weights_hash(path)


def test_the_hash_changes_with_a_loaded_file_only(sharded):
    before = weights_hash(sharded)
    save_file({"x": torch.ones(2)}, str(sharded / "consolidated.safetensors"))
    assert weights_hash(sharded) == before  # not loaded, not hashed
    shard = sharded / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard), {"format": "pt"})
    assert weights_hash(sharded) != before


def test_describe_reads_the_files_without_loading_weights(tiny_path, monkeypatch):
    monkeypatch.setattr(weights, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    model = describe_model(tiny_path)
    assert model.model_dir == tiny_path.resolve()
    assert model.name == tiny_path.name == display_name(str(tiny_path))
    assert model.max_context == 256  # the tiny model's max_position_embeddings
    assert model.weights_hash == weights_hash(tiny_path)
    assert model.chat_template == Tokenizer.from_dir(tiny_path).chat_template
    assert model.has_chat_template and model.revision is None
    tokenizer = model.load_tokenizer()
    assert tokenizer.encode("hello") == Tokenizer.from_dir(tiny_path).encode("hello")


def test_one_default_model_name():
    assert display_name(None) == DEFAULT_MODEL
    assert display_name("not-a-path-but-an-alias") == "not-a-path-but-an-alias"


@pytest.fixture
def tiny_path(tmp_path):
    return build_tiny_model(tmp_path / "tiny")
