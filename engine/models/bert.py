"""BERT-family encoders: BERT, RoBERTa, XLM-RoBERTa (and the MiniLM, bge, e5, gte
sentence-transformers checkpoints built on them), bare or with a sequence-classification
head (cross-encoder rerankers are one-label heads).

An encoder attends both ways and keeps no KV cache: a batch is its sequences packed back
to back (no padding) and attended in one pass (`worker/encoder_attention.py` builds
the per-batch object whose `attend` the layers call). Post-norm layers: LayerNorm(x +
attention(x)), then LayerNorm(h + FFN(h)); absolute learned positions (RoBERTa's start
at padding_idx + 1) and token types are added to the word embeddings.

On CPU the dense layers hold oneDNN-packed weights (quant/packed_linear.py), and the
FFN's activation and each residual add run inside the matmul that produces them
(`fused_linear.py`), so a layer writes its [tokens, intermediate] activation once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.engine.models.attention import BidirectionalAttention
from tokenmill.engine.models.config import ModelConfig, common_fields
from tokenmill.engine.models.config_fields import Refused, declare, refused
from tokenmill.engine.models.fused_linear import ACTIVATIONS, fused_linear
from tokenmill.engine.models.layers import Embedding, Linear
from tokenmill.engine.models.registry import Architecture, register

EMBED_TASKS = ("embed",)
HEAD_TASKS = ("classify", "rerank")


@dataclass
class BertConfig(ModelConfig):
    """ModelConfig plus what a BERT-family encoder adds."""

    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2
    # Position ids start here: 0 for BERT, padding_idx + 1 for RoBERTa / XLM-R.
    position_offset: int = 0
    num_labels: int = 0  # rows of the classification head (0: no head)
    roberta_head: bool = False  # the head is dense + tanh + out_proj on the first token

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings - self.position_offset


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = config.position_offset

    def forward(self, input_ids, positions, token_type_ids) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        if token_type_ids is None:  # every token of segment 0: one row, broadcast
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        # query, key and value as one matmul (`packed_modules` loads the three into it).
        self.qkv_proj = Linear(config.hidden_size, 3 * self.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, meta: BidirectionalAttention) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [num_tokens, num_heads, head_dim], views
        return meta.attend(q, k, v, self.scale).reshape(num_tokens, -1)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {config.hidden_act!r}; supported: {list(ACTIVATIONS)}"
            )
        self.activation = config.hidden_act
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, meta: BidirectionalAttention) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        attended = self.attention.self(x, meta)
        out = self.attention.output
        h = out.LayerNorm(fused_linear(out.dense, attended, residual=x))
        inner = fused_linear(self.intermediate.dense, h, activation=self.activation)
        return self.output.LayerNorm(fused_linear(self.output.dense, inner, residual=h))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """BERT's classification pooler: dense + tanh over the first token's hidden state."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig, *, with_pooler: bool = False) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if with_pooler else None

    def forward(self, input_ids, positions, token_type_ids, meta) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x


class BertForEmbedding(nn.Module):
    """A bare encoder (`BertModel`, `RobertaModel`, ...): its final hidden states are
    pooled into embeddings."""

    is_encoder = True
    # HF checkpoint names -> (our parameter name, shard index) for the fused projection.
    packed_modules = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}
    head_pooling: str | None = None  # no classification head

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.model = BertModel(config, with_pooler=self._uses_bert_pooler(config))

    @staticmethod
    def _uses_bert_pooler(config: BertConfig) -> bool:
        return False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: BidirectionalAttention,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (from 0 in each sequence), token_type_ids: [num_tokens]
        (None: all segment 0) -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, token_type_ids, meta)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name -> ours (None: a tensor this model leaves, by design).

        Bare-encoder checkpoints name tensors from the encoder down ("embeddings. ...");
        task checkpoints put them under "bert." or "roberta."; old ones call LayerNorm's
        weight and bias gamma and beta.
        """
        for prefix in ("bert.", "roberta."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name == "embeddings.position_ids":
            return None  # a buffer of 0, 1, ... older transformers saved; positions are ours
        if name.startswith("pooler.") and not self._uses_bert_pooler(self.config):
            # transformers' pooler_output (dense + tanh on the first token): pooled
            # embeddings are made from the hidden states, never from it.
            return None
        if name.endswith(".gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[: -len("beta")] + "bias"
        return name if name.startswith("classifier.") else f"model.{name}"


class BertForSequenceClassification(BertForEmbedding):
    """An encoder with a sequence-classification head over its first token: BERT's
    pooler (dense + tanh) and a linear classifier, or RoBERTa's head (dense + tanh +
    out_proj). A cross-encoder reranker is a one-label head over a (query, document)
    pair."""

    head_pooling = "cls"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        if config.num_labels < 1:
            raise ValueError("a sequence-classification model needs id2label or num_labels")
        if config.roberta_head:
            self.classifier = RobertaClassificationHead(config)
        else:
            self.classifier = Linear(config.hidden_size, config.num_labels)

    @staticmethod
    def _uses_bert_pooler(config: BertConfig) -> bool:
        return not config.roberta_head

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """The head: the first tokens' hidden states [num_seqs, hidden] -> fp32 logits
        [num_seqs, num_labels]."""
        if self.model.pooler is not None:
            first = self.model.pooler(first)
        return self.classifier(first).float()


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.out_proj = Linear(config.hidden_size, config.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


def _parse(raw: dict, *, roberta: bool) -> BertConfig:
    num_labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 0) or 0)
    architecture = (raw.get("architectures") or [None])[0]
    if architecture is None:  # an old config: its model_type names the bare encoder
        architecture = "RobertaModel" if roberta else "BertModel"
    fields = common_fields(
        raw,
        architecture=architecture,
        num_key_value_heads=raw["num_attention_heads"],
        head_dim=raw["hidden_size"] // raw["num_attention_heads"],
        hidden_act=raw.get("hidden_act", "gelu"),
        bos_token_id=None,
        eos_token_ids=[],
        sliding_window=None,
        rope_scaling=None,
        max_position_embeddings=raw.get("max_position_embeddings", 512),
        tie_word_embeddings=False,  # an encoder has no lm_head to tie
    )
    return BertConfig(
        **fields,
        layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        type_vocab_size=raw.get("type_vocab_size", 2),
        position_offset=(raw.get("pad_token_id", 1) + 1) if roberta else 0,
        num_labels=num_labels if architecture.endswith("ForSequenceClassification") else 0,
        roberta_head=roberta,
    )


def _head_dim_as_transformers_computes(value, raw: dict) -> bool:
    return value is None or value == raw["hidden_size"] // raw["num_attention_heads"]


# transformers' BertConfig, RobertaConfig and XLMRobertaConfig (the same fields), field
# by field.
CONFIG_FIELDS = declare(
    handled={
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "pad_token_id",  # RoBERTa's positions start after it
    },
    harmless={
        "hidden_dropout_prob": "dropout is off at inference",
        "attention_probs_dropout_prob": "dropout is off at inference",
        "classifier_dropout": "dropout is off at inference",
        "initializer_range": "initialises weights for training; the checkpoint replaces them",
        "use_cache": "a cache for decoder use; an encoder keeps none",
        "bos_token_id": "a tokenizer id; the encoder's forward does not read it",
        "eos_token_id": "a tokenizer id; the encoder's forward does not read it",
        "tie_word_embeddings": "ties a masked-LM head, which these models do not have",
    },
    refused={
        "is_decoder": refused("causal attention: BERT used as a decoder", False),
        "add_cross_attention": refused("cross-attention to another model's states", False),
        "position_embedding_type": refused("relative position embeddings", "absolute"),
        "head_dim": Refused(
            "heads of another size than hidden_size / num_attention_heads, which "
            "transformers' BERT computes whatever head_dim says",
            _head_dim_as_transformers_computes,
        ),
    },
)


def parse_bert_config(raw: dict) -> BertConfig:
    return _parse(raw, roberta=False)


def parse_roberta_config(raw: dict) -> BertConfig:
    return _parse(raw, roberta=True)


register(
    Architecture(
        names=("BertModel",),
        model_class=BertForEmbedding,
        parse_config=parse_bert_config,
        config_fields=CONFIG_FIELDS,
        model_types=("bert",),
        tasks=EMBED_TASKS,
    )
)
register(
    Architecture(
        names=("RobertaModel", "XLMRobertaModel"),
        model_class=BertForEmbedding,
        parse_config=parse_roberta_config,
        config_fields=CONFIG_FIELDS,
        model_types=("roberta", "xlm-roberta"),
        tasks=EMBED_TASKS,
    )
)
register(
    Architecture(
        names=("BertForSequenceClassification",),
        model_class=BertForSequenceClassification,
        parse_config=parse_bert_config,
        config_fields=CONFIG_FIELDS,
        tasks=HEAD_TASKS,
    )
)
register(
    Architecture(
        names=("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"),
        model_class=BertForSequenceClassification,
        parse_config=parse_roberta_config,
        config_fields=CONFIG_FIELDS,
        tasks=HEAD_TASKS,
    )
)
