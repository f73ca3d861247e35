"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum: `quant_method: gptq`), 4- and 8-bit,
symmetric or not, with act-order (`desc_act`) groups.

Every linear layer of the decoder blocks is quantized (less `modules_to_not_convert`,
or only `modules_in_block_to_quantize` where the config lists them); the lm_head with
`lm_head: true`. A layer's tensors (b bits, p = 32 / b codes per word):
- `qweight` int32 [k / p, n]: the codes along the inputs, code i of a column at bits
  b * (i % p) of word i // p, unsigned 0..2^b - 1;
- `qzeros` int32 [groups, n / p]: the zero points along the outputs, packed the same way;
- `scales` fp16 [groups, n]; `g_idx` int32 [k]: each input's group (with desc_act a
  permutation of the groups; without, input // group_size); groups = ceil(k /
  group_size), or 1 for group_size -1;
- a value is (q - z) * scale[g_idx]. `checkpoint_format` gptq (v1, AutoGPTQ's) stores
  each zero point minus one - z is the stored field + 1, per field, so a zero point of
  0, stored as 15, reads back as 16 as AutoGPTQ's own kernels read it; gptq_v2 stores z.
"""

from __future__ import annotations

import torch

from tokenmill.engine.quant.checkpoint.format import (
    CheckpointFormat,
    FormatReader,
    TensorSpec,
    register_format,
    unpack_int32,
)
from tokenmill.engine.quant.checkpoint.weights import IntWeight, LayerScheme

_LAYOUTS = {"gptq": "v1", "gptq_v2": "v2"}
_NEAREST = "a 4- or 8-bit GPTQ checkpoint (checkpoint_format gptq or gptq_v2) is"


class DecoderLayers(FormatReader):
    """The GPTQ/AWQ rule for which layers are quantized: the decoder blocks' linear layers
    (but those a config leaves out), and the lm_head only where it says so."""

    def __init__(self, settings: dict, scheme: LayerScheme, lm_head: bool) -> None:
        self.layer_scheme = scheme
        self.lm_head = lm_head
        self.blocks = str(settings.get("block_name_to_quantize") or "model.layers")
        self.excluded = tuple(settings.get("modules_to_not_convert") or ())
        inside = settings.get("modules_in_block_to_quantize")
        self.only = None if not inside else {n for names in inside for n in names}

    def all_schemes(self) -> list[LayerScheme]:
        return [self.layer_scheme]

    def scheme(self, module: str) -> LayerScheme | None:
        if module == "lm_head":
            return self.layer_scheme if self.lm_head else None
        if not module.startswith(f"{self.blocks}."):
            return None
        if any(part in module for part in self.excluded):
            return None
        within = module.removeprefix(f"{self.blocks}.").partition(".")[2]  # self_attn.q_proj
        if self.only is not None and within not in self.only:
            return None
        return self.layer_scheme


class GPTQReader(DecoderLayers):
    def __init__(self, settings: dict, scheme: LayerScheme, layout: str) -> None:
        super().__init__(settings, scheme, bool(settings.get("lm_head")))
        self.layout = layout

    def tensors(self, scheme, out_features, in_features):
        n, k, per_word = out_features, in_features, 32 // scheme.bits
        groups = -(-k // scheme.group_size) if scheme.group_size else 1
        return {
            "qweight": TensorSpec((torch.int32,), ((-(-k // per_word), n),), what="the codes"),
            "qzeros": TensorSpec(
                (torch.int32,), ((groups, -(-n // per_word)),), what="the zero points"
            ),
            "scales": TensorSpec(
                (torch.float16, torch.bfloat16, torch.float32), ((groups, n),), what="the scales"
            ),
            "g_idx": TensorSpec(
                (torch.int32, torch.int64), ((k,),), required=False, what="the input groups"
            ),
        }

    def decode(self, scheme, tensors, out_features, in_features):
        n, k, bits = out_features, in_features, scheme.bits
        half = 1 << (bits - 1)
        groups = tensors["scales"].shape[0]
        q = unpack_int32(tensors["qweight"].t(), bits, k)  # [n, k]
        zero = unpack_int32(tensors["qzeros"], bits, n).t().contiguous()  # [n, groups]
        if self.layout == "v1":
            zero = zero + 1
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.long()
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise ValueError(f"g_idx names groups outside 0..{groups - 1}")
            if torch.equal(g_idx, torch.arange(k) // (scheme.group_size or k)):
                g_idx = None  # groups in order: the common layout
        zero = zero - half
        return IntWeight(
            q - half,
            tensors["scales"].t().contiguous(),
            zero if bool(zero.any()) else None,
            scheme.group_size or k,
            bits,
            g_idx,
        )


class GPTQ(CheckpointFormat):
    name = "gptq"

    def accepts(self, settings: dict) -> bool:
        return str(settings.get("quant_method", "")).lower() == "gptq"

    def parse(self, settings: dict) -> GPTQReader:
        bits = settings.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits}-bit weights is not run; {_NEAREST}")
        fmt = str(settings.get("checkpoint_format") or settings.get("format") or "gptq")
        if fmt not in _LAYOUTS:
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not read; {_NEAREST}")
        pack = str(settings.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":
            raise ValueError(f"GPTQ pack_dtype {pack} is not read; int32 packing is")
        group_size = settings.get("group_size", 128)
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise ValueError(
                f"GPTQ group_size {group_size!r} is not read; a positive size or -1 is"
            )
        scheme = LayerScheme(
            format=f"gptq {_LAYOUTS[fmt]}",
            bits=bits,
            group_size=None if group_size == -1 else group_size,
            symmetric=bool(settings.get("sym", True)),
            act_order=bool(settings.get("desc_act")),
        )
        return GPTQReader(settings, scheme, _LAYOUTS[fmt])


register_format(GPTQ())
