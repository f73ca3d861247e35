"""AWQ checkpoints in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`): 4-bit
weights with a zero point per group.

The decoder blocks' linear layers are quantized, less `modules_to_not_convert`. A
layer's tensors, groups = k / group_size along the inputs:
- `qweight` int32 [k, n / 8]: eight outputs' codes per word, interleaved - field i (bits
  4i..4i+3) of word j holds output 8j + AWQ_ORDER[i];
- `qzeros` int32 [groups, n / 8]: the zero points, packed the same way;
- `scales` fp16 [groups, n]; a value is (q - z) * scale.
The gemv, gemv_fast and marlin layouts pack differently and are refused by name.
"""

from __future__ import annotations

import torch

from tokenmill.engine.quant.checkpoint.format import (
    CheckpointFormat,
    TensorSpec,
    register_format,
    unpack_int32,
)
from tokenmill.engine.quant.checkpoint.gptq import DecoderLayers
from tokenmill.engine.quant.checkpoint.weights import IntWeight, LayerScheme

# Which output each 4-bit field of a word holds.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_NEAREST = "a 4-bit AWQ checkpoint with version gemm is"


class AWQReader(DecoderLayers):
    def tensors(self, scheme, out_features, in_features):
        n, k = out_features, in_features
        groups = k // scheme.group_size
        words = n // 8
        return {
            "qweight": TensorSpec((torch.int32,), ((k, words),), what="the codes"),
            "qzeros": TensorSpec((torch.int32,), ((groups, words),), what="the zero points"),
            "scales": TensorSpec(
                (torch.float16, torch.bfloat16, torch.float32), ((groups, n),), what="the scales"
            ),
        }

    def decode(self, scheme, tensors, out_features, in_features):
        n = out_features
        q = _outputs_in_order(unpack_int32(tensors["qweight"], 4, n)).t().contiguous()
        zero = _outputs_in_order(unpack_int32(tensors["qzeros"], 4, n)).t().contiguous()
        return IntWeight(q - 8, tensors["scales"].t().contiguous(), zero - 8, scheme.group_size, 4)


def _outputs_in_order(fields: torch.Tensor) -> torch.Tensor:
    """[rows, n] fields in AWQ's interleaved order -> [rows, n] with output o at column o."""
    rows, n = fields.shape
    order = torch.tensor(AWQ_ORDER)
    columns = (torch.arange(0, n, 8)[:, None] + order[None, :]).reshape(-1)
    out = torch.empty_like(fields)
    out[:, columns] = fields
    return out


class AWQ(CheckpointFormat):
    name = "awq"

    def accepts(self, settings: dict) -> bool:
        return str(settings.get("quant_method", "")).lower() == "awq"

    def parse(self, settings: dict) -> AWQReader:
        bits = settings.get("bits", settings.get("w_bit"))
        if bits != 4:
            raise ValueError(f"AWQ with {bits}-bit weights is not run; {_NEAREST}")
        version = str(settings.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version} packs its weights for its own kernels and is not read; "
                f"{_NEAREST}"
            )
        if not settings.get("zero_point", True):
            raise ValueError(f"AWQ without zero points is not read; {_NEAREST}")
        group_size = settings.get("group_size", settings.get("q_group_size", 128))
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"AWQ group_size {group_size!r} is not read; a positive size is")
        scheme = LayerScheme("awq gemm", 4, group_size, symmetric=False)
        return AWQReader(settings, scheme, lm_head=False)


register_format(AWQ())
