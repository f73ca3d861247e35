"""A job's dry run at the 3B and 8B shapes states the memory plan before any load: the
weights at the shape's exact parameter bytes, the KV budget a share of the RAM they
leave, the rows at once that budget holds - and a job that cannot fit is refused with
the numbers and nothing written.

The checkpoints are the shapes' real dimensions (vocabulary 128,256, grouped-query
heads, Llama 3.1-8B's untied head) cut to two layers, with a real safetensors header
over a sparse file: planning reads headers only, so a 3 GB checkpoint takes no disk. A
job's id still hashes the weight files once (cached by path, size and mtime), so each
checkpoint is made once per module and the 8B one (3 GB of zeros to hash) runs as slow.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

import tokenmill.engine.worker.build as build
from tokenmill.bench.scale_shapes import checkpoint_tensors, num_parameters, shape_config
from tokenmill.engine import DEFAULT_MODEL, InsufficientMemoryError, resolve_model
from tokenmill.engine.types.memory import gib
from tokenmill.engine.worker.memory import KV_SHARE_OF_RAM_LEFT
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_forecast

GIB = 1 << 30
BLOCK_SIZE = 16  # the engine's default KV block


def _unfilled_checkpoint(out: Path, shape: str, num_layers: int | None) -> dict:
    """A model directory at `shape` (cut to `num_layers`): config, the default model's
    tokenizer, and model.safetensors with every tensor's header entry but no values
    written (a sparse file of the full size)."""
    config = shape_config(shape, num_layers=num_layers)
    out.mkdir()
    source = Path(resolve_model(DEFAULT_MODEL))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    ids = json.loads((source / "config.json").read_text())
    config |= {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in checkpoint_tensors(config):
        nbytes = 2
        for dim in spec.shape:
            nbytes *= dim
        header[spec.name] = {
            "dtype": "BF16",
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        f.truncate(8 + len(encoded) + offset)
    return config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """shape -> (its 2-layer directory, its config), made on first use."""
    made: dict[str, tuple[Path, dict]] = {}

    def get(shape: str) -> tuple[Path, dict]:
        if shape not in made:
            model_dir = tmp_path_factory.mktemp("scale-plan") / shape
            made[shape] = model_dir, _unfilled_checkpoint(model_dir, shape, num_layers=2)
        return made[shape]

    return get


def _input(path: Path) -> str:
    rows = [{"prompt": f"Question {i}: what follows {i} in the sequence?"} for i in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize(
    "shape", ["llama-3.2-3b", pytest.param("llama-3.1-8b", marks=pytest.mark.slow)]
)
def test_the_dry_run_states_the_plan_at_the_shapes_numbers(
    shape, checkpoints, tmp_path, monkeypatch
):
    model_dir, config = checkpoints(shape)
    weights = num_parameters(config) * 2  # bf16
    # By hand: 3B = embedding 128,256 x 3,072 (tied head once) + 2 x 100,669,440 per layer
    # + the final norm; 8B = embedding and head 2 x 128,256 x 4,096 + 2 x 218,112,000 + norm.
    assert weights == {"llama-3.2-3b": 1_190_688_768, "llama-3.1-8b": 2_973_802_496}[shape]
    left = 1 * GIB
    monkeypatch.setattr(build, "available_ram", lambda: weights + left)

    forecast = run_job(
        _input(tmp_path / "in.jsonl"),
        str(tmp_path / "out"),
        model=str(model_dir),
        dtype="bfloat16",
        max_tokens=1000,
        dry_run=True,
        calibrate=False,
    )
    # K and V, per layer, per KV head of head_dim values, per token of a block, in bf16.
    block_bytes = 2 * 2 * config["num_key_value_heads"] * config["head_dim"] * BLOCK_SIZE * 2
    blocks = int(left * KV_SHARE_OF_RAM_LEFT) // block_bytes
    assert (block_bytes, blocks) == (131_072, 4096)
    assert forecast.weight_bytes == weights
    assert forecast.kv_cache_bytes == blocks * block_bytes == 512 << 20
    assert forecast.memory_available_bytes == weights + left
    assert forecast.cache_blocks == blocks and forecast.max_num_seqs is None
    # The longest prompt (44 tokens in the chat template) + max_tokens: 66 blocks a row.
    assert forecast.longest_row_tokens == 1044
    assert forecast.rows_at_once == blocks // -(-1044 // BLOCK_SIZE) == 62
    assert forecast.memory.describe() == (
        f"weights {gib(weights)} (bfloat16) + KV cache 512 MiB of {gib(weights + left)} "
        "RAM available"
    )
    recorded = read_forecast(str(tmp_path / "out"))
    assert recorded["weight_bytes"] == weights and recorded["kv_cache_bytes"] == 512 << 20


@pytest.mark.parametrize(
    ("dtype", "element_bytes", "advice"),
    [("bfloat16", 2, "a smaller kv_cache_memory"), ("float32", 4, "dtype bfloat16")],
)
def test_a_job_that_cannot_fit_is_refused_with_the_numbers(
    dtype, element_bytes, advice, checkpoints, tmp_path, monkeypatch
):
    model_dir, config = checkpoints("llama-3.2-3b")
    weights = num_parameters(config) * element_bytes
    available = weights - GIB // 4
    monkeypatch.setattr(build, "available_ram", lambda: available)
    with pytest.raises(InsufficientMemoryError) as refused:
        run_job(
            _input(tmp_path / "in.jsonl"),
            str(tmp_path / "out"),
            model=str(model_dir),
            dtype=dtype,
            dry_run=True,
            calibrate=False,
        )
    message = str(refused.value)
    assert message.startswith(
        f"llama-3.2-3b does not fit in this machine's memory: weights {gib(weights)}"
    )
    assert f"({dtype})" in message and f"of {gib(available)} RAM available" in message
    assert advice in message
    assert not (tmp_path / "out" / "_forecast.json").exists()
