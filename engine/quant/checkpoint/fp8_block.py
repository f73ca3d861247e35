"""Block-wise FP8 checkpoints (`quant_method: fp8`), as Qwen's and DeepSeek's official
-FP8 repositories ship them and transformers' FineGrainedFP8 reads them.

The config: `weight_block_size` [bn, bk] (128 x 128 on the Hub), `fmt` e4m3,
`activation_scheme` dynamic, and `modules_to_not_convert` (or `ignored_layers`): layers
kept in float, each entry matching a layer name from its start up to a dot, as a regular
expression with the same boundary, or as its ending. lm_head is kept in float, as
transformers keeps the output embeddings. Every other linear layer stores
- `weight` float8_e4m3fn [n, k], the codes;
- `weight_scale_inv` fp32 [ceil(n / bn), ceil(k / bk)]: despite its name, the factor
  each block's codes are multiplied by (value = e4m3(code) * weight_scale_inv).

"dynamic" names the FP8 GPU kernels' own rounding of each 128 inputs of a token to FP8;
transformers on a CPU dequantizes these checkpoints and keeps the activations in float,
and so does this reader: the weights are the checkpoint's exactly, the inputs the
engine's. A static activation scheme (input scales stored), another `fmt`, or
power-of-two (ue8m0) scales are refused by name.
"""

from __future__ import annotations

import re

import torch

from tokenmill.engine.quant.checkpoint.format import (
    CheckpointFormat,
    FormatReader,
    TensorSpec,
    register_format,
)
from tokenmill.engine.quant.checkpoint.fp8 import fp8_weight
from tokenmill.engine.quant.checkpoint.weights import LayerScheme

_NEAREST = "a block-wise e4m3 checkpoint with activation_scheme dynamic is"
# The scale dtypes the Hub's block-wise checkpoints store (fp32; bf16 in some re-exports).
_SCALE_DTYPES = (torch.float32, torch.bfloat16)


class Fp8BlockReader(FormatReader):
    def __init__(self, scheme: LayerScheme, excluded: list[str]) -> None:
        self.layer_scheme = scheme
        # transformers' rule: from the start to a module boundary, as a regex, or a suffix.
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        self.excluded = [(re.compile(f"(?:{key}){boundary}"), key) for key in excluded]

    def all_schemes(self) -> list[LayerScheme]:
        return [self.layer_scheme]

    def scheme(self, module: str) -> LayerScheme | None:
        if module == "lm_head":
            return None
        if any(p.match(module) or module.endswith(key) for p, key in self.excluded):
            return None
        return self.layer_scheme

    def tensors(self, scheme, out_features, in_features):
        n, k = out_features, in_features
        bn, bk = scheme.block
        grid = (-(-n // bn), -(-k // bk))
        return {
            "weight": TensorSpec((torch.float8_e4m3fn,), ((n, k),), what="the fp8 codes"),
            "weight_scale_inv": TensorSpec(_SCALE_DTYPES, (grid,), what="the block scales"),
        }

    def decode(self, scheme, tensors, out_features, in_features):
        return fp8_weight("weight", tensors["weight"], tensors["weight_scale_inv"], scheme.block)


class Fp8Block(CheckpointFormat):
    name = "fp8"

    def accepts(self, settings: dict) -> bool:
        return str(settings.get("quant_method", "")).lower() == "fp8"

    def parse(self, settings: dict) -> Fp8BlockReader:
        block = settings.get("weight_block_size")
        if block is None:
            raise ValueError(
                f"quant_method fp8 without weight_block_size (per-tensor scales) is not read; "
                f"{_NEAREST}, and compressed-tensors' float-quantized FP8"
            )
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(v, int) and v > 0 for v in block)
        ):
            raise ValueError(f"quant_method fp8 weight_block_size {block!r} is not two sizes")
        fmt = str(settings.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"quant_method fp8 fmt {fmt} is not read; {_NEAREST}")
        activations = str(settings.get("activation_scheme", "dynamic")).lower()
        if activations != "dynamic":
            raise ValueError(
                f"quant_method fp8 activation_scheme {activations} (stored input scales) is not "
                f"read; {_NEAREST}"
            )
        scale_fmt = str(settings.get("scale_fmt") or "float").lower()
        if scale_fmt != "float":
            raise ValueError(
                f"quant_method fp8 scale_fmt {scale_fmt} (power-of-two scales) is not read; "
                f"{_NEAREST}"
            )
        for key in ("kv_cache_scheme", "kv_cache_quant_method"):
            if settings.get(key):
                raise ValueError(
                    f"quant_method fp8 {key}: FP8 KV-cache scales are not read (use "
                    "--kv-cache-dtype int8 instead)"
                )
        excluded = settings.get("modules_to_not_convert") or settings.get("ignored_layers") or []
        scheme = LayerScheme(
            format="fp8 block-wise",
            bits=8,
            group_size=None,
            symmetric=True,
            weight_type="fp8",
            block=(block[0], block[1]),
        )
        return Fp8BlockReader(scheme, [str(e) for e in excluded])


register_format(Fp8Block())
