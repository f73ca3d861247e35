"""LoRA adapters as PEFT saves them: found, checked against the base model, read.

An adapter is a directory - or a Hub repo id, fetched into the HF cache like a model,
at a revision - holding `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are `...layers.<i>.<self_attn|mlp>.<target>.lora_<A|B>.weight`. Everything is
checked before any weight is read (`describe_adapter` reads the config and the
safetensors header only), and every problem raises AdapterError naming the adapter:

- it is missing, or stored only as pickle (`adapter_model.bin` - never unpickled);
- it is not a plain LoRA: PEFT features that change more than the projections' low-rank
  terms are refused by name (DoRA, modules_to_save, trained biases, ...);
- its targets or shapes do not fit the base model (a module the engine does not adapt,
  a layer it does not have, lora_A/lora_B shapes against the model's projections), or
  its rank is above `max_lora_rank`;
- its base model (`base_model_name_or_path`, `auto_mapping.base_model_class`) names
  another model than the one loaded, where the loaded one's name is known.

Scaling is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, with r and
alpha per module from rank_pattern / alpha_pattern where they match (PEFT's matching).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.engine.loader import hub
from tokenmill.engine.loader.aliases import ALIASES, DEFAULT_MODEL
from tokenmill.engine.loader.model_files import file_sha256, is_hub_model
from tokenmill.engine.loader.safetensors_files import iter_tensors, read_header
from tokenmill.engine.lora.layers import LORA_TARGETS, lora_target_shapes
from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.types.config import EngineConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# A tensor of a target projection: (layer, parent module, target, A or B).
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")

# Config entries that make an adapter more than low-rank terms on the projections: each
# is refused, by name, when set to anything but its "off" value.
_REFUSED = {
    "use_dora": "DoRA (use_dora) rescales the base weights by a learned magnitude",
    "modules_to_save": "modules_to_save replaces whole modules of the base model",
    "lora_bias": "lora_bias trains a bias on lora_B",
    "layer_replication": "layer_replication duplicates base model layers",
    "trainable_token_indices": "trainable_token_indices changes embedding rows",
    "target_parameters": "target_parameters adapts raw parameters, not linear layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies per token",
    "use_qalora": "QALoRA (use_qalora) pools the input of quantized layers",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}
# init_lora_weights values that leave the base weights changed (the adapter then fits
# only the residual model PEFT saved beside it).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(ValueError):
    """An adapter that cannot be used; the message names it and the problem."""


@dataclass(frozen=True)
class AdapterTarget:
    """One projection of one layer an adapter changes."""

    layer: int
    module: str  # the PEFT target name: q_proj, k_proj, ... down_proj
    rank: int
    scaling: float  # what PEFT multiplies lora_B(lora_A(x)) by
    a_name: str  # the tensors' names in adapter_model.safetensors
    b_name: str


@dataclass(frozen=True)
class AdapterDescription:
    """A checked adapter: where it is, what it changes; its weights not yet read."""

    name: str
    path: Path  # the directory holding its files
    revision: str | None  # the Hub commit, for a repo id; None for a local directory
    weights_hash: str  # sha256 over its config and weights files
    rank: int  # its largest r
    targets: tuple[AdapterTarget, ...]
    base_model: str | None  # base_model_name_or_path, as the config gives it

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The PEFT targets it has in any layer, in the decoder's order."""
        present = {t.module for t in self.targets}
        return tuple(name for name in LORA_TARGETS if name in present)


def resolve_adapter(name: str, path: str | os.PathLike, revision: str | None = None) -> Path:
    """The directory of an adapter given as a local directory or a Hub repo id.

    Raises:
        AdapterError: no such directory or repo, a file instead of a directory, or a
            revision for a local directory.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        if revision is not None:
            raise AdapterError(
                f"LoRA adapter {name!r}: revision {revision!r} given for the local directory "
                f"{local}; a revision applies to a Hub repo id"
            )
        return local.resolve()
    if local.exists():
        raise AdapterError(f"LoRA adapter {name!r}: {local} is a file; give its directory")
    if isinstance(path, str) and hub.is_repo_id(path):
        patterns = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
        try:
            return hub.download_files(path, revision, patterns, kind="LoRA adapter")
        except hub.HubError as error:
            raise AdapterError(f"LoRA adapter {name!r}: {error}") from None
    raise AdapterError(
        f"LoRA adapter {name!r}: no adapter at {str(path)!r} (not a directory, nor a Hub "
        "repo id org/name)"
    )


def describe_adapter(
    name: str,
    path: str | os.PathLike,
    config: ModelConfig,
    *,
    revision: str | None = None,
    model_names: frozenset[str] | None = None,
    max_rank: int = EngineConfig.max_lora_rank,
) -> AdapterDescription:
    """Find an adapter and check it against the base model, reading no weights.

    Args:
        name: what the adapter is called (in messages and results).
        path: its directory or Hub repo id.
        config: the base model's config.
        revision: a branch, tag or commit of a Hub repo id.
        model_names: the base model's known names (`model_names`); None: unknown, so a
            base_model_name_or_path is not compared.
        max_rank: the largest r allowed.

    Raises:
        AdapterError: any problem the module docstring lists.
    """
    directory = resolve_adapter(name, path, revision)
    label = f"LoRA adapter {name!r} ({directory})"
    settings = _read_config(directory, label)
    _check_features(settings, label)
    _check_base_model(settings, config, model_names, label)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = [f for f in PICKLED_WEIGHTS if (directory / f).is_file()]
        if pickled:
            raise AdapterError(
                f"{label} is stored only as pickle ({pickled[0]}), which is never loaded: "
                "unpickling can run code from the file. Save it with PEFT's "
                "save_pretrained(..., safe_serialization=True) to get "
                f"{ADAPTER_WEIGHTS}"
            )
        raise AdapterError(f"{label} has no {ADAPTER_WEIGHTS}")
    try:
        shapes = {e.name: e.shape for e in read_header(weights)}
    except (ValueError, OSError) as error:
        raise AdapterError(f"{label}: {ADAPTER_WEIGHTS} cannot be read: {error}") from None
    targets = _targets(shapes, settings, config, label)
    rank = max(t.rank for t in targets)
    if rank > max_rank:
        raise AdapterError(
            f"{label} has rank {rank}, above max_lora_rank={max_rank}: raise max_lora_rank "
            "(an engine setting) to serve it"
        )
    digest = f"{file_sha256(directory / ADAPTER_CONFIG)}\n{file_sha256(weights)}"
    return AdapterDescription(
        name=name,
        path=directory,
        revision=hub.snapshot_revision(directory),
        weights_hash=_sha256(digest),
        rank=rank,
        targets=targets,
        base_model=settings.get("base_model_name_or_path"),
    )


def load_adapter(
    description: AdapterDescription,
) -> dict[AdapterTarget, tuple[torch.Tensor, torch.Tensor]]:
    """Read a described adapter's weights: per target (lora_A [r, in], lora_B [out, r]),
    in fp32 as PEFT's merge computes them."""
    wanted = {n for t in description.targets for n in (t.a_name, t.b_name)}
    tensors = dict(iter_tensors(description.path / ADAPTER_WEIGHTS, wanted))
    return {t: (tensors[t.a_name].float(), tensors[t.b_name].float()) for t in description.targets}


def model_names(model: str | os.PathLike | None) -> frozenset[str] | None:
    """The names an adapter's base_model_name_or_path may give a model argument by: an
    alias and the repo it was made from, or a Hub repo id (compared by the part after the
    last "/", case-insensitively). None for a local path: its name says nothing."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in ALIASES:
        names = {model, ALIASES[model].repo_id} - {""}
        return frozenset(_short_name(n) for n in names)
    if is_hub_model(model):
        return frozenset({_short_name(str(model))})
    return None


def _short_name(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read_config(directory: Path, label: str) -> dict:
    file = directory / ADAPTER_CONFIG
    if not file.is_file():
        raise AdapterError(f"{label} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    try:
        settings = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"{label}: {ADAPTER_CONFIG} is not valid JSON ({error})") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{label}: {ADAPTER_CONFIG} is not a JSON object")
    return settings


def _check_features(settings: dict, label: str) -> None:
    kind = settings.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"{label} is a {kind} adapter; only LoRA adapters are served")
    for key, what in _REFUSED.items():
        if settings.get(key) not in (None, False, [], {}, "", 0):
            raise AdapterError(f"{label} is not supported: {what} ({key} is set)")
    if settings.get("bias", "none") != "none":
        raise AdapterError(
            f"{label} is not supported: it trains the base model's biases "
            f"(bias={settings['bias']!r}; only 'none' is served)"
        )
    init = settings.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(
            f"{label} is not supported: init_lora_weights={init!r} changes the base weights. "
            "Save it converted to a plain LoRA (PEFT's save_pretrained with "
            "path_initial_model_for_weight_conversion)"
        )


def _check_base_model(
    settings: dict, config: ModelConfig, names: frozenset[str] | None, label: str
) -> None:
    base_class = (settings.get("auto_mapping") or {}).get("base_model_class")
    if base_class and base_class != config.architecture:
        raise AdapterError(
            f"{label} was trained on a {base_class}, and the model loaded is a "
            f"{config.architecture}"
        )
    base = settings.get("base_model_name_or_path")
    if not (names is not None and isinstance(base, str) and base):
        return  # nothing to compare
    if _short_name(base) not in names:
        raise AdapterError(
            f"{label} was trained on {base!r}, which is not the model loaded "
            f"({', '.join(sorted(names))})"
        )


def _targets(
    shapes: dict[str, tuple[int, ...]], settings: dict, config: ModelConfig, label: str
) -> tuple[AdapterTarget, ...]:
    """Every (layer, target) the weights file holds, each with its rank and scaling, the
    shapes checked against the model's projections."""
    expected = lora_target_shapes(config)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for tensor_name in shapes:
        match = _TENSOR.search(tensor_name)
        if match is None:
            raise AdapterError(
                f"{label} changes {tensor_name!r}: only the decoder's projections "
                f"({', '.join(LORA_TARGETS)}) are served"
            )
        layer, parent, module, kind = int(match[1]), match[2], match[3], match[4]
        if module not in LORA_TARGETS or LORA_TARGETS[module][0] != parent:
            raise AdapterError(
                f"{label} targets {parent}.{module} (tensor {tensor_name!r}), which the model "
                f"does not have as an adaptable projection ({', '.join(LORA_TARGETS)})"
            )
        if layer >= config.num_hidden_layers:
            raise AdapterError(
                f"{label} adapts layer {layer}, and the model has {config.num_hidden_layers} layers"
            )
        pairs.setdefault((layer, module), {})[kind] = tensor_name
    if not pairs:
        raise AdapterError(f"{label}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    use_rslora = bool(settings.get("use_rslora"))
    targets = []
    for (layer, module), names in sorted(pairs.items(), key=lambda kv: kv[0]):
        where = f"layer {layer} {module}"
        if set(names) != {"A", "B"}:
            missing = "lora_B" if "A" in names else "lora_A"
            raise AdapterError(f"{label}: {where} has no {missing} weight")
        a_shape, b_shape = shapes[names["A"]], shapes[names["B"]]
        want = expected[module]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if (
            len(a_shape) != 2
            or len(b_shape) != 2
            or a_shape[1] != want.in_features
            or b_shape[0] != want.out_features
            or b_shape[1] != rank
        ):
            raise AdapterError(
                f"{label}: {where} has lora_A {list(a_shape)} and lora_B {list(b_shape)}; "
                f"the model's {module} takes {want.in_features} inputs to "
                f"{want.out_features} outputs (lora_A [r, {want.in_features}], lora_B "
                f"[{want.out_features}, r])"
            )
        key = f"model.layers.{layer}.{LORA_TARGETS[module][0]}.{module}"
        r = _pattern_value(settings.get("rank_pattern"), key, settings.get("r", rank))
        alpha = _pattern_value(settings.get("alpha_pattern"), key, settings.get("lora_alpha", r))
        if r != rank:
            raise AdapterError(f"{label}: {where} has rank {rank}; its config says r={r}")
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        targets.append(AdapterTarget(layer, module, rank, scaling, names["A"], names["B"]))
    return tuple(targets)


def _pattern_value(pattern: dict | None, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern that matches the end
    of the module's name (peft.utils.other.get_pattern_key)."""
    for regex, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({regex})$", key):
            return value
    return default
