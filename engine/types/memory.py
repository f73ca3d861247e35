"""`MemoryPlan`: what an engine takes of the machine's memory, planned before its load
(`worker/memory.py` makes it; `LLM.memory` and a job's forecast show it)."""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 1 << 30


class InsufficientMemoryError(ValueError):
    """The engine's weights and KV cache would not fit in the RAM left (a ValueError: a
    setting or a model this machine cannot run, refused before anything is loaded)."""


@dataclass(frozen=True)
class MemoryPlan:
    """An engine's memory, planned before its load (`worker/memory.py` says how)."""

    device: str
    dtype: str  # the engine's float dtype, in which the load holds the weights
    weight_bytes: int  # every parameter in that dtype: the load's peak for the weights
    kv_cache_bytes: int  # the KV cache the engine allocates (0: an encoder)
    kv_cache_blocks: int
    available_bytes: int | None  # RAM the process may still take; None: not planned (CUDA)

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        """One line: what the engine takes, of what is left."""
        kv = f" + KV cache {gib(self.kv_cache_bytes)}" if self.kv_cache_bytes else ""
        line = f"weights {gib(self.weight_bytes)} ({self.dtype}){kv}"
        if self.available_bytes is None:
            return f"{line} on {self.device}"
        return f"{line} of {gib(self.available_bytes)} RAM available"

    def check(self, model: str) -> None:
        """Raise InsufficientMemoryError, with the numbers and what would help, when the
        engine cannot fit."""
        if self.fits:
            return
        # A quantization mode does not help: the load holds the float weights first.
        help_ = ["a smaller model"]
        if self.kv_cache_bytes:
            help_.insert(0, "a smaller kv_cache_memory")
        if self.dtype == "float32":
            help_.insert(0, "dtype bfloat16")
        raise InsufficientMemoryError(
            f"{model} does not fit in this machine's memory: {self.describe()} "
            f"(needs {gib(self.needed_bytes)}); try {', '.join(help_)}"
        )


def gib(num_bytes: int) -> str:
    """`num_bytes` as a reader takes it in: GiB to two places, else MiB, else KiB."""
    if num_bytes >= _GIB:
        return f"{num_bytes / _GIB:.2f} GiB"
    if num_bytes >= 1 << 20:
        return f"{num_bytes / (1 << 20):.0f} MiB"
    return f"{num_bytes / 1024:.0f} KiB"
