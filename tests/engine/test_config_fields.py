"""Every registered architecture's config fields: each field of transformers' config class
declared (handled, harmless or refused), and each refused one, switched on, refused by
name - before any weight is read."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers
from hf_models import save_char_tokenizer

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.models import (
    architecture_of,
    load_config,
    parse_config,
    supported_architectures,
)
from tokenmill.engine.models.config_fields import BASE_FIELDS

ARCHITECTURES = supported_architectures()

# Small shapes, valid for every family's config class.
DECODER_SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
ENCODER_SHAPE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)

# A value that switches each refusable field on: every field some architecture refuses
# needs one here, so a field added to a table is tested by this file.
SWITCHED_ON = {
    "attention_bias": True,
    "mlp_bias": True,
    "use_sliding_window": True,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "partial_rotary_factor": 0.5,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 64,
    "use_bidirectional_attention": True,
    "use_qk_norm": True,
    "qk_layernorm": True,
    "clip_qkv": 8.0,
    "logits_scaling": 4.0,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 64,
    "moe_intermediate_size": 64,
    "is_decoder": True,
    "add_cross_attention": True,
    "position_embedding_type": "relative_key",
    "head_dim": 7,
}


def transformers_config_class(name: str):
    return getattr(transformers, name).config_class


def transformers_config(name: str) -> dict:
    """config.json as transformers writes it for `name`, at transformers' defaults."""
    config_class = transformers_config_class(name)
    is_encoder = architecture_of({"architectures": [name]}).is_encoder
    if "text_config" in getattr(config_class, "sub_configs", {}):  # a vision-language model
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
        text = DECODER_SHAPE
        if name == "Qwen2_5_VLForConditionalGeneration":
            vision = dict(hidden_size=32, intermediate_size=64, depth=1, out_hidden_size=32)
        if name == "Qwen2VLForConditionalGeneration":
            vision = dict(embed_dim=32, hidden_size=32, depth=1)
        if name.startswith("Qwen2"):  # M-RoPE bands that fit head_dim 8
            text = {**text, "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2]}}
        raw = config_class(text_config=text, vision_config=vision).to_dict()
    else:
        raw = config_class(**(ENCODER_SHAPE if is_encoder else DECODER_SHAPE)).to_dict()
    return {**raw, "architectures": [name]}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_transformers_defaults_parse(name):
    config = parse_config(transformers_config(name))
    assert config.architecture == name
    assert (config.hidden_size, config.num_hidden_layers) == (32, 2)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_field_of_transformers_config_class_is_declared(name):
    declared = architecture_of({"architectures": [name]}).config_fields.declared
    config_class = transformers_config_class(name)
    class_fields = {f.name for f in dataclasses.fields(config_class)}
    assert class_fields - declared == set()
    # What transformers writes into config.json, beyond its class's fields.
    assert set(transformers_config(name)) - declared == set()


def test_base_fields_are_transformers_base_fields():
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    assert base <= set(BASE_FIELDS)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_refused_field_switched_on_is_refused_by_name(name):
    fields = architecture_of({"architectures": [name]}).config_fields
    raw = transformers_config(name)
    refusals = fields.refusals()
    assert set(refusals) <= set(SWITCHED_ON)
    assert "mlp_bias" in refusals or name.startswith("Llama")
    for field in refusals:
        switched = {**raw, field: SWITCHED_ON[field]}
        with pytest.raises(ValueError, match=rf"{name}: config.json sets {field} = "):
            parse_config(switched)


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("LlamaForCausalLM", "attention_bias", True),
        ("LlamaForCausalLM", "mlp_bias", True),
        ("LlamaForCausalLM", "pretraining_tp", 4),
        ("Qwen2ForCausalLM", "use_sliding_window", True),
        ("Qwen2ForCausalLM", "attention_bias", False),
        ("Qwen3ForCausalLM", "attention_bias", True),
        ("MistralForCausalLM", "layer_types", ["sliding_attention", "sliding_attention"]),
        ("Gemma3ForCausalLM", "attention_bias", True),
        ("Gemma3ForCausalLM", "final_logit_softcapping", 30.0),
        ("BertModel", "head_dim", 8),
        ("BertModel", "position_embedding_type", "absolute"),
        ("RobertaModel", "hidden_dropout_prob", 0.3),
    ],
)
def test_handled_and_harmless_values_pass(name, field, value):
    parse_config({**transformers_config(name), field: value})


def test_off_values_pass_for_every_architecture():
    """What transformers writes for a field switched off is never refused."""
    for name in ARCHITECTURES:
        raw = transformers_config(name)
        raw.update(
            {"mlp_bias": False, "attn_logit_softcapping": None, "partial_rotary_factor": 1.0}
        )
        parse_config(raw)


def test_llama_and_mistral_windows_are_their_own():
    """transformers' Llama attends to everything whatever sliding_window says (refused:
    the checkpoint was trained with one); Mistral slides every layer, 4096 by default."""
    llama = transformers_config("LlamaForCausalLM")
    with pytest.raises(ValueError, match="sliding_window = 4096"):
        parse_config({**llama, "sliding_window": 4096})
    assert parse_config({**llama, "sliding_window": None}).sliding_window is None
    mistral = transformers_config("MistralForCausalLM")
    del mistral["sliding_window"]
    config = parse_config(mistral)
    assert [config.layer_sliding_window(i) for i in range(2)] == [4096, 4096]


@pytest.mark.parametrize("kind", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_window_follows_transformers(kind):
    raw = transformers_config(kind)
    assert parse_config(raw).sliding_window is None  # use_sliding_window is off
    on = {
        **raw,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
        "num_hidden_layers": 3,
        "layer_types": None,
    }
    config = parse_config(on)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert [config.layer_sliding_window(i) for i in range(3)] == [None, 8, 8]
    reference = transformers_config_class(kind)(**{**DECODER_SHAPE, **on})
    assert config.layer_types == reference.layer_types
    # layer_types as written are the rule, max_window_layers or not.
    written = ["sliding_attention", "full_attention", "full_attention"]
    config = parse_config({**on, "layer_types": written})
    assert [config.layer_sliding_window(i) for i in range(3)] == [8, None, None]
    with pytest.raises(ValueError, match="chunked_attention"):
        parse_config({**on, "num_hidden_layers": 2, "layer_types": ["chunked_attention"] * 2})


def test_qwen3_head_dim_defaults_as_transformers_does():
    raw = transformers_config("Qwen3ForCausalLM")
    del raw["head_dim"]
    assert parse_config(raw).head_dim == 128 == transformers.Qwen3Config().head_dim


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "proportional", "factor": 4.0}, "rope_scaling type 'proportional'"),
        ({"rope_type": "mrope", "mrope_section": [2, 2]}, "rope_scaling type 'mrope'"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "needs long_factor"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
        ({"rope_type": "llama3", "factor": 8.0, "attention_factor": 0.7}, "attention_factor"),
    ],
)
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"])
def test_rope_scalings_not_computed_are_refused_by_name(name, rope, message):
    raw = {**transformers_config(name), "rope_parameters": None, "rope_scaling": rope}
    with pytest.raises(ValueError, match=message):
        parse_config(raw)


def test_llama3_rope_original_context_defaults_to_the_models():
    raw = {
        **transformers_config("LlamaForCausalLM"),
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 500000.0,
        },
    }
    scaling = parse_config(raw).rope_scaling
    assert scaling["original_max_position_embeddings"] == 4096
    reference = transformers.LlamaConfig(**{**DECODER_SHAPE, **raw})
    assert reference.rope_parameters["original_max_position_embeddings"] == 4096


def test_unsupported_activation_is_refused_by_name():
    raw = {**transformers_config("LlamaForCausalLM"), "hidden_act": "relu2"}
    with pytest.raises(ValueError, match="hidden_act 'relu2'"):
        parse_config(raw)


def test_refused_before_any_weight_is_read(tmp_path):
    """The field is named though the weights file is not even safetensors."""
    raw = {**transformers_config("Qwen2ForCausalLM"), "mlp_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    save_char_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="mlp_bias"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM: config.json sets mlp_bias = True"):
        LLM(str(tmp_path), dtype="float32")


def test_unsupported_architecture_is_refused_naming_the_nearest(tmp_path):
    """Named before any weight is read (the weights file is not even safetensors)."""
    raw = {**transformers_config("LlamaForCausalLM"), "architectures": ["Phi4ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    save_char_tokenizer(tmp_path)
    with pytest.raises(
        ValueError,
        match="unsupported architecture 'Phi4ForCausalLM' \\(nearest: 'Phi3ForCausalLM'\\)",
    ):
        LLM(str(tmp_path), dtype="float32")
