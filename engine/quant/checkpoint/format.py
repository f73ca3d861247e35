"""The interface a checkpoint format implements, and the registry each format joins.

A format reads config.json's `quantization_config` (`parse`, before any weight is read:
every variant it cannot run is refused there, by name) into a FormatReader, which says
for each checkpoint layer how it is quantized (`scheme`), which tensors hold it, with
their dtypes and shapes (`tensors`: checked against the headers, still before any weight
is read), and how those tensors decode into an IntWeight (`decode`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill.engine.quant.checkpoint.weights import IntWeight, LayerScheme

# The float dtypes a checkpoint stores scales in.
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a quantized layer needs: its dtypes and the shapes it may have."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    required: bool = True
    what: str = ""  # what it holds, for errors: "the scales"


class FormatReader(ABC):
    """A parsed quantization_config: what each layer is, and how to read it."""

    @abstractmethod
    def all_schemes(self) -> list[LayerScheme]:
        """Every scheme the config names (what `tokenmill models info` and the ledger say),
        whether or not a layer of this model takes it."""

    @abstractmethod
    def scheme(self, module: str) -> LayerScheme | None:
        """How the checkpoint layer `module` ("model.layers.0.self_attn.q_proj") is
        quantized; None: it is stored in float (ignored or not targeted)."""

    @abstractmethod
    def tensors(
        self, scheme: LayerScheme, out_features: int, in_features: int
    ) -> dict[str, TensorSpec]:
        """The layer's tensors by suffix ("weight_packed", "qweight"...), bias excluded."""

    @abstractmethod
    def decode(
        self,
        scheme: LayerScheme,
        tensors: dict[str, torch.Tensor],
        out_features: int,
        in_features: int,
    ) -> IntWeight:
        """The layer's tensors (as `tensors` declared them, checked) -> its IntWeight.

        Raises:
            ValueError: a value the format does not allow (a code out of range, a stored
                shape that differs), naming the tensor.
        """


class CheckpointFormat(ABC):
    """One quantization format of checkpoints on the Hub (see module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def accepts(self, settings: dict) -> bool:
        """Whether this quantization_config is this format's (any variant of it)."""

    @abstractmethod
    def parse(self, settings: dict) -> FormatReader:
        """The reader for these settings.

        Raises:
            ValueError: a variant this format's reader does not run, by name, with the
                nearest one it does.
        """


_FORMATS: list[CheckpointFormat] = []


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Make a format known (its module calls this once)."""
    if any(f.name == fmt.name for f in _FORMATS):
        raise ValueError(f"checkpoint format {fmt.name!r} is registered twice")
    _FORMATS.append(fmt)
    return fmt


def format_for(settings: dict) -> CheckpointFormat | None:
    """The registered format that reads these settings, or None."""
    return next((f for f in _FORMATS if f.accepts(settings)), None)


def check_tensor(name: str, spec: TensorSpec, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise ValueError, naming the tensor, when a header's dtype or shape is not the spec's."""
    if dtype not in spec.dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        raise ValueError(
            f"quantized tensor {name} is {str(dtype).removeprefix('torch.')}, expected {allowed}"
        )
    if tuple(shape) not in spec.shapes:
        allowed = " or ".join(str(s) for s in spec.shapes)
        raise ValueError(f"quantized tensor {name} has shape {tuple(shape)}, expected {allowed}")


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [..., words] holding `bits`-bit fields from the lowest bits up (element i of
    a row at bit i * bits of the row's little-endian bytes) -> int16 [..., count], the
    fields as unsigned values."""
    raw = packed.contiguous().view(torch.uint8)  # little-endian: word j is bytes 4j..4j+3
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit fields are not unpacked here")
    per_byte = 8 // bits
    if raw.shape[-1] * per_byte < count:
        raise ValueError(f"{raw.shape[-1] * per_byte} packed fields, expected at least {count}")
    if bits == 8:
        return raw[..., :count].to(torch.int16)
    # written straight into the result: a layer's temporaries are what its load peaks on
    fields = torch.empty((*raw.shape[:-1], raw.shape[-1] * 2), dtype=torch.int16)
    fields[..., 0::2] = raw & 15
    fields[..., 1::2] = raw >> 4
    return fields[..., :count] if fields.shape[-1] == count else fields[..., :count].clone()
