"""Quantized tensors made in the tests by the reference tools' own code, so that no
quantized weights are committed: llm-compressor's data-free checkpoints rebuilt with
compressed-tensors (the package llm-compressor writes them with), and auto-round's GPTQ
and AWQ packers run on known codes. Each import is deferred to the call: collecting the
engine tests must not pay for these packages."""

from __future__ import annotations

from pathlib import Path

import torch

LLMCOMPRESSOR_SCHEMES = ("W4A16_ASYM", "W8A8", "FP8_DYNAMIC")


def tiny_llama_config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


def write_llmcompressor_checkpoint(out: Path, scheme_name: str, scheme=None) -> Path:
    """What llm-compressor's data-free `oneshot(model, QuantizationModifier(targets=
    "Linear", scheme=scheme_name, ignore=["lm_head"]))` then `save_pretrained(out,
    save_compressed=True)` writes for a random one-layer bf16 Llama (seed 7), step by step
    with the compressed-tensors calls llm-compressor makes:

    1. `apply_quantization_config` attaches the preset scheme to every Linear but lm_head
       and gives each a `weight_scale` (in the weight's dtype, bf16) and zero point;
    2. its weight observer, memoryless min-max, takes the min and max of the bf16 weight
       over each output channel (W8A8, FP8_DYNAMIC) or each row's 128-input group
       (W4A16_ASYM), and `calculate_qparams` turns them into the scale and zero point
       (the activations of W8A8 and FP8_DYNAMIC are dynamic: nothing is calibrated);
    3. `ModelCompressor.from_pretrained_model(...).compress_model` quantizes and packs
       each weight with the format's compressor (pack-quantized, int-quantized,
       float-quantized), and `update_config` writes the quantization_config.

    Every tensor this writes was checked to equal, byte for byte, the checkpoints
    llm-compressor 0.14 (compressed-tensors 0.19) wrote from the same model; only the
    config's `version` and its unset (None) fields differ.

    `scheme`, a compressed-tensors QuantizationScheme, replaces the preset (its name then
    only labels the call): the FP8 weight-only variants llm-compressor has no preset for
    (per channel, per tensor, in blocks dividing the weights)."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = transformers.LlamaForCausalLM(tiny_llama_config()).to(torch.bfloat16)
    if scheme is None:
        scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    scheme.weights.observer = "memoryless_minmax"  # what llm-compressor records it used
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            args = module.quantization_scheme.weights
            weight = module.weight
            if args.strategy == "block":  # [n / bn, k / bk] blocks
                bn, bk = args.block_structure
                blocks = weight.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk)).transpose(1, 2)
                low, high = blocks.amin((-2, -1)), blocks.amax((-2, -1))
            elif args.strategy == "tensor":
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            else:
                if args.group_size is not None:
                    weight = weight.unflatten(-1, (-1, args.group_size))
                low, high = weight.amin(-1), weight.amax(-1)
                if args.group_size is None:
                    low, high = low.unsqueeze(-1), high.unsqueeze(-1)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


AUTO_ROUND_CASES = ("gptq4", "gptq8", "awq4")
_N, _K, _GROUP = 64, 128, 32


def _known_layer(bits: int, seed: int):
    """Random codes, zero points and fp16 scales, and the Linear whose weight is exactly
    their dequantization - what the packers are given."""
    generator = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (_N, _K), generator=generator)
    # GPTQ v1 stores a zero point minus one: 0 cannot be stored, so zeros start at 1.
    zeros = torch.randint(1, top + 1, (_N, _K // _GROUP), generator=generator)
    scales = (torch.rand(_N, _K // _GROUP, generator=generator) * 0.02 + 0.001).half()
    groups = torch.arange(_K) // _GROUP
    linear = torch.nn.Linear(_K, _N, bias=False)
    linear.weight.data = (codes - zeros[:, groups]).float() * scales.float()[:, groups]
    return codes, zeros, scales, linear


def auto_round_packed() -> dict[str, dict[str, torch.Tensor]]:
    """One 64 x 128 layer (groups of 32) packed by auto-round's own packers: its GPTQ v1
    packer (`auto_round_extension.torch.qlinear_torch_zp.QuantLinear`, zero points stored
    minus one) at 4 and 8 bits, and its AWQ GEMM packer (`WQLinear_GEMM.from_linear`).
    Per case: the inputs `codes`, `zeros` (unsigned) and `scales` (fp16), and the packer's
    `qweight`, `qzeros` and `scales_out`."""
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    cases = {}
    for bits, seed in ((4, 1), (8, 2)):
        codes, zeros, scales, linear = _known_layer(bits, seed)
        layer = QuantLinear(bits, _GROUP, _K, _N, False, g_idx=True)
        layer.pack(linear, scales.float(), zeros.clone(), device="cpu")
        outputs = {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales_out": layer.scales}
        cases[f"gptq{bits}"] = {"codes": codes, "zeros": zeros, "scales": scales, **outputs}
    codes, zeros, scales, linear = _known_layer(4, 3)
    awq = WQLinear_GEMM.from_linear(
        linear, 4, _GROUP, scales=scales.t().float(), zeros=zeros.t().clone(), device="cpu"
    )
    outputs = {"qweight": awq.qweight, "qzeros": awq.qzeros, "scales_out": awq.scales}
    cases["awq4"] = {"codes": codes, "zeros": zeros, "scales": scales, **outputs}
    return cases
