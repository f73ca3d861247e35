"""Decode-only steps replayed from CUDA graphs.

A decode step of a small model is hundreds of short kernels; launched one by one from
Python, the GPU waits on the host between them. So the model's forward pass over a batch
of decoding sequences is captured once per batch-size bucket and replayed: one launch per
step. Every bucket reads the same static input buffers (one int64 buffer, filled by one
copy from pinned memory per step); a batch smaller than its bucket is padded with
sequences of length 0, which store nothing and attend to nothing. Steps with prompt
chunks run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tokenmill.engine.core.step import PendingStep, SchedulerOutput
from tokenmill.engine.cuda.triton_attention import TritonAttention
from tokenmill.engine.worker.attention.triton import TritonMetadata

# Batch sizes with a graph of their own (up to max_num_seqs, which always gets one):
# fine steps where padding would cost the most relative to the work, coarser above.
_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_FIELDS = (
    "input_ids",
    "positions",
    "slot_blocks",
    "slot_offsets",
    "seq_lens",
    "fill_rows",
    "fill_from",
)


class DecodeGraphs:
    """One captured forward pass per bucket, over shared static inputs.

    Args:
        runner: the `ModelRunner` whose model, rotary tables and cache are captured.
        max_num_seqs: the largest decode batch the scheduler forms.
        max_model_len: bounds every block table's width.
    """

    def __init__(self, runner: Any, max_num_seqs: int, max_model_len: int) -> None:
        self.runner = runner
        self.sizes = sorted({b for b in _BUCKETS if b < max_num_seqs} | {max_num_seqs})
        self.max_blocks = -(-max_model_len // runner.block_size)
        size = self.max_size
        # Static inputs, all views of one device buffer so a step needs one upload:
        # [input_ids | positions | slot_blocks | slot_offsets | seq_lens | fill_rows |
        #  fill_from | block_tables (size x max_blocks)]
        self._buffer = torch.zeros(
            len(_FIELDS) * size + size * self.max_blocks, dtype=torch.int64, device=runner.device
        )
        self.inputs = {
            name: self._buffer[i * size : (i + 1) * size] for i, name in enumerate(_FIELDS)
        }
        self.block_tables = self._buffer[len(_FIELDS) * size :].view(size, self.max_blocks)
        self.query_starts = torch.arange(size + 1, device=runner.device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._pool = None  # the memory pool every graph shares
        self._capture()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, out: SchedulerOutput) -> bool:
        """Whether a graph covers this step: decode tokens only, few enough sequences."""
        return not out.prefills and 0 < len(out.decodes) <= self.max_size

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the static inputs -> [size, hidden]."""
        runner = self.runner
        x = {name: t[:size] for name, t in self.inputs.items()}
        meta = TritonMetadata(
            slot_blocks=x["slot_blocks"],
            slot_offsets=x["slot_offsets"],
            sequences=TritonAttention(
                query_starts=self.query_starts[: size + 1],
                seq_lens=x["seq_lens"],
                block_tables=self.block_tables[:size],
                num_decodes=size,
            ),
        )
        return runner.forward_model(x["input_ids"], x["positions"], meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        # Padding everywhere: the warm-up and captured runs store and attend to nothing.
        self.inputs["slot_blocks"].fill_(-1)
        for size in reversed(self.sizes):  # largest first, so smaller ones reuse its memory
            self._graphs[size] = self._capture_one(size)

    def _capture_one(self, size: int) -> tuple[Callable[[], None], torch.Tensor]:
        """(replay, its output [size, hidden]) for one bucket."""
        self._forward(size)  # compiles the kernels and settles the allocator
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(size)
        self._pool = graph.pool()
        return graph.replay, hidden

    def run(
        self, out: SchedulerOutput, previous: PendingStep | None
    ) -> tuple[torch.Tensor, list[int]]:
        """Replay the smallest graph that holds the step.

        Returns:
            (hidden states [num_decodes, hidden], the rows to sample)
        """
        runner = self.runner
        step = runner.step_tokens(out)
        num = len(out.decodes)
        size = self.sizes[bisect.bisect_left(self.sizes, num)]
        full = self.max_size
        host = np.zeros(len(_FIELDS) * full + size * self.max_blocks, dtype=np.int64)
        fields = {name: host[i * full : (i + 1) * full] for i, name in enumerate(_FIELDS)}
        fields["input_ids"][:num] = np.where(step.token_ids < 0, 0, step.token_ids)
        fields["positions"][:num] = step.positions
        fields["slot_blocks"][:num] = step.slots // runner.block_size
        fields["slot_blocks"][num:] = -1  # padding rows store nothing ...
        fields["slot_offsets"][:num] = step.slots % runner.block_size
        fields["seq_lens"][:num] = step.positions + 1  # ... and, with length 0, see nothing
        num_fill = len(step.placeholder_rows)
        fields["fill_rows"][:num_fill] = step.placeholder_rows
        fields["fill_from"][:num_fill] = step.previous_rows
        tables = host[len(_FIELDS) * full :].reshape(size, self.max_blocks)
        for row, table in enumerate(step.tables):
            tables[row, : len(table)] = table
        self._buffer[: host.size].copy_(runner.staged(host), non_blocking=True)
        if num_fill:
            runner.fill_placeholders(
                self.inputs["input_ids"],
                self.inputs["fill_rows"][:num_fill],
                self.inputs["fill_from"][:num_fill],
                previous,
            )
        replay, hidden = self._graphs[size]
        replay()
        return hidden[:num], step.sample_rows
