"""The `gguf` mode's lm_head: a GGUF's Q4_0, Q4_1 or Q8_0 output weight packed for oneDNN
a slice of rows at a time, straight from its blocks.

The head is the float layer left in this mode, packed once at load (quant/
packed_linear.py). Loaded as float and then packed, it was in memory twice at the pack:
Llama 3's 128,256 x 4,096 head is 1 GB in bf16, its packed copy another 1 GB - the
mode's peak at start. Here the load leaves it out (the mode's hold-out) and the mode puts
a BlockHead in its place: a RowWeight whose rows are decoded from the file's blocks on
demand (kernels/gguf_dequantize.c: the float load's values, bit for bit), which
pack_linear_layers packs slice by slice into the final buffer, or builds as nn.Linear
where it does not pack (or where the mode quantizes the head to int8).

Only an untied head, in an fp32 or bf16 engine: a tied one is the embedding's matrix.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.kernels import gguf_dequantize
from tokenmill.engine.loader.gguf_tensors import GGUFTensors
from tokenmill.engine.loader.tensor_plan import TensorSource
from tokenmill.engine.quant.gguf_embedding import block_kind
from tokenmill.engine.quant.packed_linear import RowWeight

HEAD = "lm_head.weight"


class PendingHead(RowWeight):
    """Stands in for the lm_head from the load's hold-out until `build_block_head`
    replaces it: the float load fills nothing of it."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self._dtype = head.weight.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        raise RuntimeError("the GGUF lm_head was read before its blocks were loaded")


class BlockHead(RowWeight):
    """The lm_head's weight in the file's blocks, rows decoded in `dtype` on demand."""

    def __init__(self, raw: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        if kind not in gguf_dequantize.KINDS or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a {kind} lm_head in {dtype} is not decoded by rows here")
        self.kind, self._dtype = kind, dtype
        self.raw = raw  # mapped from the file: no memory of its own
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // gguf_dequantize.KINDS[kind][1] * 32

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return gguf_dequantize.dequantize_blocks(self.raw[start:stop], self.kind, self._dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind} blocks"


def _kept(model: nn.Module, kind: str | None) -> bool:
    head = getattr(model, "lm_head", None)
    return (
        kind is not None
        and not model.config.tie_word_embeddings
        and isinstance(head, nn.Linear)
        and head.bias is None
        and head.weight.dtype in (torch.float32, torch.bfloat16)
    )


def hold_out_head(model_dir: Path, model: nn.Module, sources: list[TensorSource]) -> set[str]:
    """The load's hold-out for the lm_head (see module docstring): a PendingHead in its
    place and its name held, where it is read from blocks; else nothing."""
    if not _kept(model, block_kind(model_dir, HEAD)):
        return set()
    model.lm_head = PendingHead(model.lm_head)
    return {HEAD}


def build_block_head(model: nn.Module, model_dir: Path) -> None:
    """Replace a PendingHead with the BlockHead of the file's raw rows (nothing where the
    head was not held out)."""
    pending = getattr(model, "lm_head", None)
    if not isinstance(pending, PendingHead):
        return
    kind = block_kind(model_dir, HEAD)
    raw = GGUFTensors.open_dir(model_dir).raw_blocks([HEAD])[HEAD]
    head = BlockHead(raw, kind, pending.dtype)
    if (head.out_features, head.in_features) != (pending.out_features, pending.in_features):
        want = (pending.out_features, pending.in_features)
        raise ValueError(f"the GGUF lm_head's blocks are not {want}")
    model.lm_head = head
