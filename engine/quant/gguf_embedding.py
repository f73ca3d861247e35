"""The `gguf` mode's token embedding: a GGUF's Q4_0, Q4_1 or Q8_0 embedding kept in its
blocks, only the rows a step looks up decoded (what llama.cpp's get_rows does).

Llama 3's embedding is 128,256 x 4,096: 282 MB in Q4_0, 1 GB in bf16. Decoding it
whole at every start costs a pass over it and the difference in memory, for rows most
steps never read. Here the load leaves it out (the mode's hold-out), and the mode builds
a BlockEmbedding from the file's raw rows: each step gathers its tokens' rows of blocks
and decodes them natively (kernels/gguf_dequantize.c) in the engine's dtype - the value
the float load gives each row, bit for bit (fp32: the gguf package's; bf16: those
rounded as torch rounds them).

Only an untied embedding, in an fp32 or bf16 engine: a tied one is also the lm_head,
whose product reads the whole matrix, so it loads as float as before.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.kernels import gguf_dequantize
from tokenmill.engine.loader.gguf_tensors import GGUFTensors, gguf_source
from tokenmill.engine.loader.tensor_plan import TensorSource

EMBEDDING = "model.embed_tokens.weight"


class PendingEmbedding(nn.Module):
    """Stands in for the embedding from the load's hold-out until `build_block_embedding`
    replaces it: the float load fills nothing of it."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        # What the model reads `embed_tokens.weight.dtype` for; it holds no values.
        self.register_buffer(
            "weight", torch.empty(0, dtype=embedding.weight.dtype), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the GGUF embedding was used before its blocks were loaded")


class BlockEmbedding(nn.Module):
    """Token ids -> their rows of a GGUF embedding, decoded from its blocks per call."""

    def __init__(self, raw: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        if kind not in gguf_dequantize.KINDS or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a {kind} embedding in {dtype} is not decoded per row here")
        self.kind = kind
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = raw.shape[1] // gguf_dequantize.KINDS[kind][1] * 32
        self.register_buffer("raw", raw.contiguous(), persistent=False)
        # The engine's float dtype, which the model reads as `embed_tokens.weight.dtype`:
        # an empty tensor, so that any use of it as the matrix fails rather than misleads.
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)
        self.weight_bytes = raw.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw.index_select(0, input_ids.reshape(-1))
        decoded = gguf_dequantize.dequantize_blocks(rows, self.kind, self.weight.dtype)
        return decoded.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} blocks"


def block_kind(model_dir: Path, hf_name: str) -> str | None:
    """The GGML type in which this model's GGUF file stores tensor hf_name, where it is a
    format decoded natively by rows, or None: not a model run from its GGUF file, no
    native kernels, or another format (then it loads as float)."""
    if gguf_source(model_dir) is None or not gguf_dequantize.available():
        return None
    tensors = GGUFTensors.open_dir(model_dir)
    layout = tensors.layout
    kinds = {layout.hf_tensor_name(e.name): e.kind for e in tensors.weights()}
    kind = kinds.get(hf_name)
    return kind if kind in gguf_dequantize.KINDS else None


def embedding_kind(model_dir: Path) -> str | None:
    """block_kind of the embedding."""
    return block_kind(model_dir, EMBEDDING)


def _kept(model: nn.Module, kind: str | None) -> bool:
    embedding = model.model.embed_tokens
    return (
        kind is not None
        and not model.config.tie_word_embeddings
        and isinstance(embedding, nn.Embedding)
        and embedding.weight.dtype in (torch.float32, torch.bfloat16)
    )


def hold_out_embedding(model_dir: Path, model: nn.Module, sources: list[TensorSource]) -> set[str]:
    """The load's hold-out for the embedding (see module docstring): a PendingEmbedding
    in its place and its name held, where it is kept in blocks; else nothing."""
    if not _kept(model, embedding_kind(model_dir)):
        return set()
    model.model.embed_tokens = PendingEmbedding(model.model.embed_tokens)
    return {EMBEDDING}


def embedding_block_bytes(model_dir: Path, model: nn.Module) -> dict[nn.Module, int]:
    """For the memory plan, given the model on the meta device: {embedding: the bytes of
    its blocks} where it is kept in blocks, else {}."""
    kind = embedding_kind(model_dir)
    if not _kept(model, kind):
        return {}
    tensors = GGUFTensors.open_dir(model_dir)
    return {model.model.embed_tokens: tensors.stored_bytes()[EMBEDDING]}


def build_block_embedding(model: nn.Module, model_dir: Path) -> int:
    """Replace a PendingEmbedding with the BlockEmbedding of the file's raw rows; returns
    its bytes (0: the embedding was not held out)."""
    pending = model.model.embed_tokens
    if not isinstance(pending, PendingEmbedding):
        return 0
    kind = embedding_kind(model_dir)
    raw = GGUFTensors.open_dir(model_dir).raw_blocks([EMBEDDING])[EMBEDDING]
    embedding = BlockEmbedding(raw, kind, pending.weight.dtype)
    if (embedding.num_embeddings, embedding.embedding_dim) != (
        pending.num_embeddings,
        pending.embedding_dim,
    ):
        want = (pending.num_embeddings, pending.embedding_dim)
        raise ValueError(f"the GGUF embedding's blocks are not {want}")
    model.model.embed_tokens = embedding
    return embedding.weight_bytes
