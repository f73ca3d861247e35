"""Random-weight pooling models built in a test - BERT-family encoders (bare and with a
classification head) and decoders (Qwen3Model, Qwen2ForSequenceClassification) - with
a tokenizer each and, when asked, sentence-transformers' files; HF `transformers` is the
reference on the same weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "and",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "be",
    "are",
    "or",
    "not",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "house",
    "car",
    "road",
    "city",
    "river",
    "sea",
    "sky",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "red",
    "blue",
    "green",
    "small",
    "large",
    "old",
    "new",
    "good",
    "bad",
    "search",
    "query",
    "document",
    "passage",
    "answer",
    "question",
    "retrieve",
    "relevant",
    "web",
    "data",
    "model",
    "embedding",
    "vector",
    "score",
    "rank",
    "list",
    "table",
    "row",
    "column",
    "file",
    "text",
    "word",
    "token",
]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

SMALL_ENCODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.2,
)
SMALL_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
)


def wordpiece_tokenizer(*, roberta: bool = False) -> Tokenizer:
    """A lowercasing WordPiece tokenizer over WORDS and the alphabet, with BERT's
    templates ("[CLS] A [SEP]", pair "[CLS] A [SEP] B [SEP]" with type ids 0 then 1), or
    RoBERTa's ("<s> A </s>", pair "<s> A </s></s> B </s>")."""
    specials = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"] if roberta else BERT_SPECIALS
    letters = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'")
    vocab = {
        t: i for i, t in enumerate([*specials, *WORDS, *letters, *(f"##{c}" for c in letters)])
    }
    unk = specials[1]
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = specials[2], specials[3]
    if roberta:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} {sep} $B {sep}",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0",
            pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
    tok.add_special_tokens(specials)
    return tok


def _save_tokenizer(tok: Tokenizer, out_dir: Path, **config) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def build_encoder(kind: str, out_dir: Path, *, num_labels: int = 0, **overrides):
    """Save a random-weight encoder checkpoint and its tokenizer; return the HF model.

    Args:
        kind: bert | roberta | xlm-roberta.
        num_labels: 0 for the bare model, else a *ForSequenceClassification head.
    """
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    roberta = kind != "bert"
    tok = wordpiece_tokenizer(roberta=roberta)
    config_cls = {
        "bert": transformers.BertConfig,
        "roberta": transformers.RobertaConfig,
        "xlm-roberta": transformers.XLMRobertaConfig,
    }[kind]
    settings = {**SMALL_ENCODER, "vocab_size": tok.get_vocab_size(), **overrides}
    if roberta:
        settings.update(pad_token_id=0, type_vocab_size=1)
        settings["max_position_embeddings"] = settings["max_position_embeddings"] + 2
    if num_labels:
        settings["num_labels"] = num_labels
    config = config_cls(**settings)
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[kind]
    suffix = "ForSequenceClassification" if num_labels else "Model"
    model_cls = getattr(transformers, prefix + suffix)
    torch.manual_seed(1234)
    model = (
        model_cls(config, add_pooling_layer=False)
        if suffix == "Model" and roberta
        else model_cls(config)
    ).eval()
    with torch.no_grad():  # random-init biases and norms are 0 and 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(tok, out_dir, do_lower_case=True)
    return model


def build_decoder(kind: str, out_dir: Path, *, num_labels: int = 0, **overrides):
    """Save a random-weight decoder that pools - `Qwen3Model` / `Qwen2Model` (kind
    qwen3 | qwen2), or with num_labels its *ForSequenceClassification - with the tiny
    byte-level BPE tokenizer; return the HF model."""
    import transformers
    from tiny_model import build_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config_cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config}[kind]
    settings = {**SMALL_DECODER, "vocab_size": tok.get_vocab_size(), **overrides}
    if kind == "qwen3":
        settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    if num_labels:
        settings.update(num_labels=num_labels, pad_token_id=0)
    config = config_cls(**settings)
    prefix = {"qwen3": "Qwen3", "qwen2": "Qwen2"}[kind]
    model_cls = getattr(
        transformers, prefix + ("ForSequenceClassification" if num_labels else "Model")
    )
    torch.manual_seed(4321)
    model = model_cls(config).eval()
    if kind == "qwen2":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(tok, out_dir, eos_token="<|endoftext|>")
    return model


def build_sentence_encoder(out_dir: Path, *, max_seq_length: int | None = None) -> Path:
    """A random BERT embedding model as sentence-transformers saves one (mean pooling,
    normalized), the one the job, flow and fault tests embed with."""
    build_encoder("bert", out_dir)
    write_sentence_transformers_files(out_dir, normalize=True, max_seq_length=max_seq_length)
    return Path(out_dir)


def write_sentence_transformers_files(
    model_dir: Path,
    *,
    pooling_mode: str | list[str] = "mean",
    normalize: bool = True,
    max_seq_length: int | None = None,
    prompts: dict[str, str] | None = None,
    legacy_flags: bool = False,
) -> None:
    """modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json,
    sentence_bert_config.json and config_sentence_transformers.json, as
    sentence-transformers saves them (the legacy `pooling_mode_*` flags if asked)."""
    model_dir = Path(model_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    modes = [pooling_mode] if isinstance(pooling_mode, str) else list(pooling_mode)
    if legacy_flags:
        names = {
            "cls": "pooling_mode_cls_token",
            "mean": "pooling_mode_mean_tokens",
            "max": "pooling_mode_max_tokens",
            "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
            "weightedmean": "pooling_mode_weightedmean_tokens",
            "lasttoken": "pooling_mode_lasttoken",
        }
        pooling = {"word_embedding_dimension": hidden, **{names[m]: True for m in modes}}
    else:
        pooling = {
            "embedding_dimension": hidden,
            "pooling_mode": modes[0] if len(modes) == 1 else modes,
        }
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    bert = {"do_lower_case": False}
    if max_seq_length is not None:
        bert["max_seq_length"] = max_seq_length
    (model_dir / "sentence_bert_config.json").write_text(json.dumps(bert))
    st = {"prompts": prompts or {}, "default_prompt_name": None}
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps(st))
