"""Loading safetensors by mapping: a weight kept as stored is the file's pages (no
anonymous memory), a converted or fused one is a copy, and writes never reach the file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from tokenmill.bench.scale_build import build_scale_model

# Llama 3's real vocabulary at a narrow width: the two 128,256-row matrices (131 MB in
# bf16) are whole parameters, mapped; q/k/v and gate/up are fused, so copied.
_OVERRIDES = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

_SCRIPT = """
import gc, json, sys
import torch
from pathlib import Path
from tokenmill.engine.loader.weights import load_model
from tokenmill.engine.models import load_config

def rss(kind):
    for line in open("/proc/self/status"):
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024

model_dir, dtype = Path(sys.argv[1]), getattr(torch, sys.argv[2])
config = load_config(model_dir)
# A first load pays for imports and first-call set-up; the second is the weights alone.
load_model(model_dir, config, dtype=dtype, device=torch.device("cpu"))
gc.collect()
before = rss("RssAnon")
model = load_model(model_dir, config, dtype=dtype, device=torch.device("cpu"))
growth = rss("RssAnon") - before
# A weight the engine drops (as packing a linear layer does) takes its pages with it.
model.lm_head.weight.float().sum()  # every page of the 66 MB lm_head touched
touched = rss("RssFile")
del model.lm_head.weight
gc.collect()
print(json.dumps({"growth": growth, "released": touched - rss("RssFile")}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("mmap") / "llama"
    return build_scale_model("llama-3.1-8b", num_layers=2, overrides=_OVERRIDES, out_dir=out)


def _load_in_child(model_dir, dtype: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(model_dir), dtype],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _bytes_of(model_dir, *parts: str) -> int:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(
            f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1] * 2
            for name in f.keys()
            if any(f".{part}." in name for part in parts)
        )


def test_bf16_into_bf16_takes_anonymous_memory_only_for_fused_weights(model_dir):
    size = (model_dir / "model.safetensors").stat().st_size
    fused = _bytes_of(model_dir, "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert size > 130e6 and fused < 5e6
    measured = _load_in_child(model_dir, "bfloat16")
    # The fused copies, plus allocator slack; the 131 MB of embedding and lm_head are not
    # there (a copied load grows by the whole file: the next test).
    assert measured["growth"] < fused + 16e6, (measured, fused, size)
    assert measured["released"] > 60e6, measured  # the lm_head's 66 MB left with it


def test_a_converted_load_copies_every_weight(model_dir):
    size = (model_dir / "model.safetensors").stat().st_size
    # fp32: twice the bf16 bytes, all of it the process's own
    assert _load_in_child(model_dir, "float32")["growth"] > 1.9 * size


def test_mapped_weights_are_the_files_values_and_writes_stay_private(model_dir):
    from tokenmill.engine.loader.weights import load_model
    from tokenmill.engine.models import load_config

    path = model_dir / "model.safetensors"
    before = path.read_bytes()
    model = load_model(
        model_dir, load_config(model_dir), dtype=torch.bfloat16, device=torch.device("cpu")
    )
    with safe_open(str(path), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        down = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, down)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q)
    model.model.embed_tokens.weight.data.mul_(2)
    model.model.layers[1].mlp.down_proj.weight.data.zero_()
    assert torch.equal(model.model.embed_tokens.weight, embed * 2)
    del model
    assert path.read_bytes() == before
