"""The quantization method interface, and the registry each mode joins.

A method is an object with a name and help text that checks whether a model can run
quantized its way here (`check`, before any weight is read) and swaps a loaded model's
linear layers for its own (`quantize`); `layer_classes` lists the modules it makes, so
tools that walk a model (profiling, memory reports) know them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from tokenmill.engine.loader.heap import return_freed_heap
from tokenmill.engine.loader.weights import HoldOut
from tokenmill.engine.models import ModelConfig

# (model, layers, calibration token ids) -> {layer: max|x| per input channel}: one float
# forward pass recording the layers' inputs, run by the worker (worker/calibration.py).
MeasureInputs = Callable[[nn.Module, list[nn.Module], list[int]], dict[nn.Module, torch.Tensor]]
# (model, a module's qualified name) -> None: called by the load as each module's weights
# are complete (loader/weights.py's OnFilled).
OnFilled = Callable[[nn.Module, str], None]
# (model on the meta device) -> {linear layer: bytes of its weight as the mode holds it}
# for each layer whose weight a mode's hold-out leaves out of the float load.
HeldOutBytes = Callable[[nn.Module], dict[nn.Module, int]]
# Where quantized_targets looks: the decoder layers, by their qualified names.
_DECODER_LAYERS = "model.layers."


class QuantizationMethod(ABC):
    """One way for a model's linear layers to hold their weights (see module docstring)."""

    name: ClassVar[str]
    help: ClassVar[str]
    layer_classes: ClassVar[tuple[type[nn.Module], ...]]
    # Whether `quantize(..., lm_head=True)` also quantizes the lm_head.
    quantizes_lm_head: ClassVar[bool] = False
    # The native grouped kernel's weight format (kernels/moe.py) this mode packs a
    # mixture of experts' experts in - from their weights alone, with no activation
    # statistics, so the load packs each layer as it fills (worker/build.py); None: the
    # mode does not quantize experts (quant's check refuses such models).
    expert_format: ClassVar[str | None] = None

    def load_quantizer(self) -> OnFilled | None:
        """A callback for the load that quantizes each decoder linear layer the moment
        its weights are filled (`filled_layer_quantizer`), so that the float weights of
        all layers are never alive at once; None (the default) where the mode needs the
        whole float model first. `quantize` then swaps what the load left float."""
        return None

    def hold_out(self, model_dir: Path) -> HoldOut | None:
        """The load's hold-out (loader/weights.py) for the checkpoint tensors this mode
        reads in their stored format itself - so the float load never expands them - or
        None (the default): the mode quantizes the float weights the load fills."""
        return None

    def held_out_bytes(self, model_dir: Path) -> HeldOutBytes | None:
        """Where `hold_out` leaves tensors out of the float load: for a model built on
        the meta device, the most bytes each held-out linear layer's weight can take once the
        mode has built it (the memory plan counts those, not a float weight: memory.py). None (the
        default) where the mode holds nothing out; a mode with a hold-out overrides it."""
        return None

    def loaded_layer_bytes(self, out_features: int, in_features: int, bias: bool) -> int:
        """Bytes a decoder linear layer [out, in] takes once `load_quantizer`'s callback
        has swapped it (the memory plan counts the load's peak with it: memory.py).
        Only asked of modes that have a load_quantizer."""
        raise NotImplementedError(f"quantization {self.name!r} does not quantize as it loads")

    def held_layer_bytes(self) -> Callable[[int, int, bool], int] | None:
        """(out_features, in_features, bias) -> the bytes a decoder linear layer takes once
        the mode has swapped it, load and quantization over (the memory plan sizes the KV
        cache beside these: memory.py). By default `loaded_layer_bytes` where the mode
        quantizes as it loads, else None: the layers stay as the load left them."""
        return self.loaded_layer_bytes if self.load_quantizer() is not None else None

    def held_head_bytes(self) -> Callable[[int, int, bool], int] | None:
        """The same for the lm_head where `quantize(..., lm_head=True)` swaps it; None
        (the default) where the mode never quantizes it."""
        return None

    def check(self, model_dir: Path, config: ModelConfig, device: torch.device) -> None:
        """Raise ValueError when this model cannot run this way on `device`; by default
        a method runs on the CPU only."""
        if device.type != "cpu":
            raise ValueError(f"quantization={self.name!r} runs on CPU only, not {device.type}")

    @abstractmethod
    def quantize(
        self,
        model: nn.Module,
        model_dir: Path,
        *,
        dtype: torch.dtype,
        measure_inputs: MeasureInputs,
        lm_head: bool,
    ) -> int:
        """Swap the model's decoder linear layers in place - and its lm_head with
        `lm_head` (only where `quantizes_lm_head`); returns the bytes their weights now
        take."""


_METHODS: dict[str, QuantizationMethod] = {}


def register(method: QuantizationMethod) -> QuantizationMethod:
    """Make a method known by its name (its module calls this once)."""
    if method.name in _METHODS:
        raise ValueError(f"quantization {method.name!r} is registered twice")
    _METHODS[method.name] = method
    return method


def registered() -> dict[str, QuantizationMethod]:
    """Every registered method by name."""
    return dict(_METHODS)


def quantized_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every float linear layer inside the decoder layers
    (the embeddings are never quantized; the lm_head only where a method offers it)."""
    return [
        (parent, name, child)
        for layer in model.model.layers
        for parent in layer.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


def filled_layer_quantizer(quantize_linear: Callable[[nn.Linear], nn.Module]) -> OnFilled:
    """A load's callback swapping each float linear layer of the decoder layers (those
    quantized_targets lists) for `quantize_linear(layer)` as soon as it is filled: its
    float weight is then freed (a mapped one unmapped, its file pages with it) before the
    next layer's are read, and the heap's freed temporaries go back to the system."""

    def quantize_filled(model: nn.Module, name: str) -> None:
        if not name.startswith(_DECODER_LAYERS):
            return
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            return
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, quantize_linear(linear))
        del linear
        return_freed_heap()

    return quantize_filled
