"""Random-weight models at published shapes: the layout transformers expects, the same
greedy tokens in tokenmill and transformers, deterministic bytes, and a build whose
memory stays far below the model's size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from tokenmill.bench.scale_build import build_scale_model
from tokenmill.bench.scale_shapes import SHAPE_NAMES, SHAPES, num_parameters, shape_config

# Every dimension small but the ratios kept (grouped-query heads, experts, top-k).
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 49152,
}


def _tiny(name: str) -> dict:
    return {k: v for k, v in _TINY.items() if k in SHAPES[name]}


def test_published_parameter_counts():
    counts = {name: num_parameters(shape_config(name)) for name in SHAPE_NAMES}
    assert counts == {
        "qwen2.5-1.5b": 1_543_714_304,
        "llama-3.2-3b": 3_212_749_824,
        "llama-3.1-8b": 8_030_261_248,
        "olmoe-1b-7b": 6_919_161_856,
        "qwen3-30b-a3b": 30_532_122_624,
        "mixtral-8x7b": 46_702_792_704,
    }


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown model shape 'llama-9b'"):
        shape_config("llama-9b")
    with pytest.raises(ValueError, match="num_layers must be 1..28"):
        shape_config("qwen2.5-1.5b", num_layers=29)
    with pytest.raises(ValueError, match="'rope_theta' cannot be overridden"):
        shape_config("qwen2.5-1.5b", overrides={"rope_theta": 1.0})
    with pytest.raises(ValueError, match="llama-3.1-8b has no 'num_experts'"):
        shape_config("llama-3.1-8b", overrides={"num_experts": 4})
    with pytest.raises(ValueError, match="mixtral-8x7b's vocabulary of 32,000 is smaller"):
        build_scale_model("mixtral-8x7b", num_layers=1, out_dir=tmp_path / "m")
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        build_scale_model("llama-3.1-8b", dtype="float16", out_dir=tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_transformers_loads_every_tensor_and_tokenmill_agrees(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenmill.engine import LLM, SamplingParams

    model_dir = build_scale_model(
        name, num_layers=2, overrides=_tiny(name), dtype="float32", out_dir=tmp_path / name
    )
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["vocab_size"] == _TINY["vocab_size"]
    hf, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
        assert f.get_tensor("model.norm.weight").eq(1).all()
    assert torch.equal(hf.model.layers[1].self_attn.o_proj.weight, stored)
    assert 0.015 < stored.std().item() < 0.025
    prompt = [5, 6, 7, 8, 9]
    llm = LLM(str(model_dir), dtype="float32")
    ours = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert list(ours[0].outputs[0].token_ids) == theirs[0, len(prompt) :].tolist()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, monkeypatch):
    import tokenmill.bench.scale_build as scale_build

    # Shards of 1 MB: the embedding, the layers and norm, the lm_head (6 MB each in bf16).
    monkeypatch.setattr(scale_build, "MAX_SHARD_BYTES", 1 << 20)
    overrides = _tiny("llama-3.1-8b")
    dirs = [
        build_scale_model(
            "llama-3.1-8b", num_layers=2, overrides=overrides, seed=seed, out_dir=tmp_path / str(i)
        )
        for i, seed in enumerate((7, 7, 8))
    ]
    index = json.loads((dirs[0] / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
    assert index["metadata"]["total_size"] == 2 * num_parameters(
        shape_config("llama-3.1-8b", num_layers=2, overrides=overrides)
    )
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] == shards[1]
    same = [(d / shards[1]).read_bytes() for d in dirs]
    assert same[0] == same[1] != same[2]


def test_cached_build_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    first = build_scale_model("olmoe-1b-7b", num_layers=1, overrides=_tiny("olmoe-1b-7b"))
    assert first.parent == tmp_path / "scale-models"
    assert first.name.startswith("olmoe-1b-7b-L1-bfloat16-s0-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = build_scale_model("olmoe-1b-7b", num_layers=1, overrides=_tiny("olmoe-1b-7b"))
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "scale-models").iterdir()] == [first.name]


def test_peak_memory_while_building_is_far_below_the_model(tmp_path):
    # Llama 3's real vocabulary at a narrow width: two 128,256-row matrices, 256 MB in
    # fp32, drawn and written a chunk at a time.
    script = textwrap.dedent(
        f"""
        import json, sys
        from tokenmill.bench.scale_build import build_scale_model
        from tokenmill.engine import DEFAULT_MODEL, resolve_model

        resolve_model(DEFAULT_MODEL)  # the engine's imports are not the build's memory

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

        # VmHWM is the process's peak since it started, and resolving the default model
        # may peak higher than the build (reading it on a fresh cache): reset it here.
        open("/proc/self/clear_refs", "w").write("5")
        before = status("VmRSS:")
        out = build_scale_model(
            "llama-3.1-8b", num_layers=1, dtype="float32", out_dir={str(tmp_path / "m")!r},
            overrides={{"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 64}},
        )
        print(json.dumps({{"growth": status("VmHWM:") - before}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    model_bytes = (tmp_path / "m" / "model.safetensors").stat().st_size
    assert model_bytes > 260e6
    assert growth < model_bytes / 4, (growth, model_bytes)


def test_bench_cli_refuses_a_shape_beside_a_model_or_layers_without_a_shape(tmp_path):
    from click.testing import CliRunner

    from tokenmill.cli import main

    def run(*args):
        return CliRunner().invoke(main, ["bench", "--preset", "smoke", *args])

    both = run("--shape", "qwen2.5-1.5b", "--model", "x")
    assert both.exit_code == 2 and "--model and --shape name two models" in both.output
    alone = run("--shape-layers", "2")
    assert alone.exit_code == 2 and "needs --shape" in alone.output
    deep = run("--shape", "qwen2.5-1.5b", "--shape-layers", "29")
    assert deep.exit_code == 1 and "num_layers must be 1..28" in deep.output
    unknown = run("--shape", "llama-9b")
    assert unknown.exit_code == 2 and "'llama-9b' is not one of" in unknown.output
