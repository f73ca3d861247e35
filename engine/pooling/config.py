"""How a model pools, read from its directory: sentence-transformers' files and the
classification head's config.

    modules.json                       the module chain: Transformer -> Pooling -> Normalize
    1_Pooling/config.json              the pooling mode(s): cls, mean, max,
                                       mean_sqrt_len_tokens, weightedmean, lasttoken
                                       (legacy `pooling_mode_*` flags or `pooling_mode`)
    sentence_bert_config.json          max_seq_length (texts are cut to it), do_lower_case
    config_sentence_transformers.json  named prompts ("query": "Instruct: ...") and the
                                       default prompt name
    config.json                        id2label, problem_type, and a cross-encoder's
                                       activation (`sentence_transformers.activation_fn`)

A directory without modules.json pools as its kind does by default: an encoder by the
mean over its tokens, a decoder by its last token (what embedding decoders are trained
with), neither normalised. A module the engine cannot run (Dense, a custom module), a
pooling over only part of the prompt (`include_prompt: false`) or a Transformer module
kept in a subfolder is refused by name when the model is asked to embed, never
skipped: skipping it would give embeddings that look right and are not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.engine.models import GENERATE, architecture_of

# sentence-transformers' pooling modes, in the order it concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# A cross-encoder's activation as sentence-transformers stores it -> ours.
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


@dataclass(frozen=True)
class PoolingConfig:
    """How a model turns final hidden states into an embedding, probabilities or a score."""

    modes: tuple[str, ...]  # POOLING_MODES entries; several are concatenated in that order
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None = None  # texts are cut to this many tokens (None: context)
    lowercase: bool = False  # sentence-transformers lowercases text before tokenizing
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before a text
    default_prompt_name: str | None = None
    # Why the model cannot embed (an unsupported module), or None.
    unsupported: str | None = None
    # The classification head: label names in logit order (config.json's id2label).
    labels: tuple[str, ...] = ()
    classify_activation: str = "softmax"  # or "sigmoid" (one label, or multi-label)
    rerank_activation: str = "sigmoid"  # a cross-encoder's: sigmoid, identity or tanh
    from_sentence_transformers: bool = False  # read from modules.json

    @property
    def num_modes(self) -> int:
        return len(self.modes)


def read_pooling_config(model_dir: str | Path, *, is_encoder: bool) -> PoolingConfig:
    """The pooling a model directory declares, or its kind's default.

    Args:
        model_dir: an HF-layout model directory.
        is_encoder: the model attends both ways (BERT family): mean pooling by default;
            a decoder's default is its last token.

    Raises:
        ValueError: a sentence-transformers file that is not valid JSON.
    """
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json") or {}
    head = _head_fields(config)
    modules = _read_json(model_dir / "modules.json")
    default = ("mean",) if is_encoder else ("lasttoken",)
    if modules is None:
        return PoolingConfig(modes=default, normalize=False, **head)
    unsupported = None
    modes, normalize = default, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = module.get("path", "")
        if kind == "Transformer":
            if path:
                unsupported = f"its Transformer module is in a subfolder ({path!r})"
        elif kind == "Pooling":
            modes, problem = _pooling_modes(_read_json(model_dir / path / "config.json") or {})
            unsupported = unsupported or problem
        elif kind == "Normalize":
            normalize = True
        else:
            unsupported = (
                unsupported or f"modules.json lists a {kind or 'custom'} module ({path!r})"
            )
    bert = _read_json(model_dir / "sentence_bert_config.json") or {}
    st = _read_json(model_dir / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") if isinstance(st.get("prompts"), dict) else {}
    return PoolingConfig(
        modes=modes,
        normalize=normalize,
        max_seq_length=bert.get("max_seq_length"),
        lowercase=bool(bert.get("do_lower_case", False)),
        prompts={str(k): str(v) for k, v in prompts.items()},
        default_prompt_name=st.get("default_prompt_name"),
        unsupported=unsupported,
        from_sentence_transformers=True,
        **head,
    )


def _pooling_modes(raw: dict[str, Any]) -> tuple[tuple[str, ...], str | None]:
    """(modes, why they cannot be served or None) of a Pooling module's config."""
    problem = None
    if raw.get("include_prompt") is False:
        problem = "its Pooling module leaves the prompt out (include_prompt: false)"
    mode = raw.get("pooling_mode")
    if mode is not None:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for key, m in _LEGACY_MODE_KEYS.items() if raw.get(key))
    modes = modes or ("mean",)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        problem = problem or f"pooling mode {unknown[0]!r} is not one of {', '.join(POOLING_MODES)}"
        modes = tuple(m for m in modes if m in POOLING_MODES) or ("mean",)
    # sentence-transformers concatenates the modes in its own fixed order.
    return tuple(m for m in POOLING_MODES if m in modes), problem


def _head_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The classification head's labels and activations from config.json."""
    id2label = config.get("id2label") or {}
    try:
        labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int))
    except (TypeError, ValueError):
        labels = tuple(str(v) for v in id2label.values())
    num_labels = len(labels) or int(config.get("num_labels", 0) or 0)
    multi_label = config.get("problem_type") == "multi_label_classification"
    st = config.get("sentence_transformers") or {}
    path = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    return {
        "labels": labels,
        "classify_activation": "sigmoid" if num_labels == 1 or multi_label else "softmax",
        "rerank_activation": _ACTIVATIONS.get(path, "sigmoid" if num_labels <= 1 else "identity"),
    }


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def served_tasks(model_dir: str | Path) -> tuple[str, ...]:
    """What a model directory can be asked to do (registry TASKS): its architecture's
    tasks, less embed for a causal LM whose directory does not say how it pools (no
    sentence-transformers modules.json) - a language model's hidden states are not an
    embedding model's."""
    model_dir = Path(model_dir)
    architecture = architecture_of(_read_json(model_dir / "config.json") or {})
    tasks = architecture.tasks
    if GENERATE in tasks and not (model_dir / "modules.json").is_file():
        tasks = tuple(t for t in tasks if t != "embed")
    return tasks


def embedding_size(model_dir: str | Path, config: PoolingConfig) -> int:
    """Values in the model's embeddings: its hidden size per pooling mode (several
    modes are concatenated)."""
    raw = _read_json(Path(model_dir) / "config.json") or {}
    return int(raw["hidden_size"]) * len(config.modes)
