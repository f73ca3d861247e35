"""Weights offered only as pickle are refused, with the reason, and never unpickled.

Each pickle here would create a marker file when unpickled (what a malicious checkpoint
does with `__reduce__`); torch.load and every pickle entry point fail the test if they
are called at all.
"""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from store_fixtures import _isolated_cache  # noqa: F401 - fixture
from tiny_model import build_tiny_model

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader.model_files import ModelFilesError
from tokenmill.pipelines.job import run_job

PICKLED_NAMES = ["pytorch_model.bin", "model.pt", "weights.pth", "model.ckpt"]


class Payload:
    """Unpickling this runs `open(marker, "w")`: proof that the file was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    class RefusingUnpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("weights") / "tiny")


def pickled_model(tiny_dir, tmp_path, name: str):
    """A copy of the tiny model whose only weights are a booby-trapped pickle `name`."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "unpickled.marker"
    (model / name).write_bytes(pickle.dumps(Payload(str(marker))))
    return model, marker


@pytest.mark.parametrize("name", PICKLED_NAMES)
def test_pickle_only_weights_are_refused_with_the_reason(tiny_dir, tmp_path, name, no_unpickling):
    model, marker = pickled_model(tiny_dir, tmp_path, name)

    with pytest.raises(ModelFilesError) as info:
        LLM(str(model), device="cpu", dtype="float32", kv_cache_memory=8 << 20)

    message = str(info.value)
    assert f"found {name}: pickled weights are never loaded" in message
    assert "because unpickling can run code from the file" in message
    assert "convert them to safetensors" in message
    assert not marker.exists()


def test_a_job_on_pickle_only_weights_fails_before_compute(tiny_dir, tmp_path, no_unpickling):
    model, marker = pickled_model(tiny_dir, tmp_path, "pytorch_model.bin")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n')
    out = tmp_path / "out"

    with pytest.raises(ModelFilesError, match="pickled weights are never loaded"):
        run_job(str(src), str(out), model=str(model), max_tokens=2, dtype="float32")

    assert not marker.exists()
    assert not (out / "results").exists()  # nothing was computed or written
