"""`MemoryPlan`: what an engine takes of the machine's memory, planned before its load
(`worker/memory.py` makes it; `LLM.memory` and a job's forecast show it)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.types.config import MAX_RUNNING_SEQS

_GIB = 1 << 30


class InsufficientMemoryError(ValueError):
    """The engine's weights and KV cache would not fit in the RAM left (a ValueError: a
    setting or a model this machine cannot run, refused before anything is loaded)."""


@dataclass(frozen=True)
class MemoryPlan:
    """An engine's memory, planned before its load (`worker/memory.py` says how)."""

    device: str
    dtype: str  # the engine's float dtype, in which the load holds the weights
    # The load's peak for the weights: every parameter in that dtype, but a mixture of
    # experts' experts packed as the engine runs them, and one layer's float ones (and
    # where a mode quantizes as it loads, its layers quantized and one float).
    weight_bytes: int
    kv_cache_bytes: int  # the KV cache the engine allocates (0: an encoder)
    kv_cache_blocks: int
    available_bytes: int | None  # RAM the process may still take; None: not planned (CUDA)
    # Sequences running at once: the user's max_num_seqs, or None where the KV cache
    # decides - each admitted only while it holds its prompt + max_tokens beside what the
    # running ones may still take (core/scheduler.py).
    max_num_seqs: int | None = None
    block_size: int = 0  # tokens a KV block holds (0: not stated)
    # What the engine holds of its weights once the load is over, where a mode makes that
    # less than the load's peak (int8 quantizes a float model after the load; int4 holds
    # one layer's float weights at a time while it fills): the KV cache is allocated
    # after the load, beside these bytes, not beside the peak. None: the peak.
    held_bytes: int | None = None

    @property
    def held_weight_bytes(self) -> int:
        """The weights' bytes from the KV cache's allocation on."""
        return self.weight_bytes if self.held_bytes is None else self.held_bytes

    @property
    def needed_bytes(self) -> int:
        """The most the engine takes at once: the load's peak, or the weights it keeps
        and the KV cache beside them, whichever is more."""
        return max(self.weight_bytes, self.held_weight_bytes + self.kv_cache_bytes)

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        """One line: what the engine takes, of what is left."""
        kv = f" + KV cache {gib(self.kv_cache_bytes)}" if self.kv_cache_bytes else ""
        line = f"weights {gib(self.weight_bytes)} ({self.dtype}){kv}"
        if self.held_weight_bytes != self.weight_bytes:
            line = (
                f"weights {gib(self.held_weight_bytes)} as the engine holds them{kv} "
                f"(the load's peak {gib(self.weight_bytes)} in {self.dtype})"
            )
        if self.available_bytes is None:
            return f"{line} on {self.device}"
        return f"{line} of {gib(self.available_bytes)} RAM available"

    def rows_at_once(self, row_tokens: int) -> int:
        """How many rows of `row_tokens` tokens each (prompt + max_tokens) run at once:
        max_num_seqs where set, else as many as the KV cache holds whole - at least one
        (a row runs alone, however long), at most MAX_RUNNING_SEQS."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        row_blocks = -(-row_tokens // max(self.block_size, 1))
        return max(1, min(MAX_RUNNING_SEQS, self.kv_cache_blocks // max(row_blocks, 1)))

    def describe_rows(self, row_tokens: int | None = None) -> str:
        """How many sequences run at once, and why; with `row_tokens` (a job's longest
        prompt + max_tokens) the number for rows of that length."""
        if self.max_num_seqs is not None:
            return (
                f"{self.max_num_seqs:,} (max_num_seqs as set: admitted on their prompt, the "
                "newest preempted and recomputed when the KV cache runs out)"
            )
        cache = f"{self.kv_cache_blocks:,} KV blocks of {self.block_size} tokens"
        if row_tokens is None:
            return (
                f"as many as {cache} hold at each one's prompt + max_tokens, at most "
                f"{MAX_RUNNING_SEQS} (max_num_seqs unset: none is preempted)"
            )
        row_blocks = -(-row_tokens // max(self.block_size, 1))
        fit = self.kv_cache_blocks // row_blocks
        limit = ""
        if fit > MAX_RUNNING_SEQS:
            limit = f", at most {MAX_RUNNING_SEQS} run at once"
        elif fit == 0:
            limit = ": one runs alone, cut at the cache's end"
        return (
            f"{self.rows_at_once(row_tokens):,}: {cache} hold {fit:,} rows of "
            f"{row_tokens:,} tokens (the longest prompt + max_tokens){limit}; max_num_seqs "
            "unset, so none is preempted"
        )

    def check(self, model: str) -> None:
        """Raise InsufficientMemoryError, with the numbers and what would help, when the
        engine cannot fit."""
        if self.fits:
            return
        # Only the modes that quantize as they load (int4, gguf) lower the load's peak.
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
