"""Runs one scheduled step: flatten its chunks into one unpadded batch, run the
model, compute logits only where a token is sampled (and at the prompt rows of
requests that asked for prompt log-probabilities), and sample.

Attention goes through one backend (`worker/attention/`), chosen when the runner starts:
the first that serves the model's attention shape, dtype, device and KV cache dtype.
Where the backend allows, decode-only steps replay a CUDA graph (`worker/cuda_graphs.py`),
and a step's inputs go up from pinned memory without waiting for the device, so the host
can prepare step N+1 while step N runs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.engine.core.grammar import TokenBitmask
from tokenmill.engine.core.mrope import mrope_delta, mrope_positions
from tokenmill.engine.core.step import (
    PendingStep,
    SamplerOutput,
    SchedulerOutput,
    Sequence,
    StepResult,
)
from tokenmill.engine.kernels.paged_attention import stores_pairs
from tokenmill.engine.lora.manager import LoRAManager
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.models.attention import StepAttention
from tokenmill.engine.models.gemma3_vision import StepImages
from tokenmill.engine.models.moe import track_expert_usage
from tokenmill.engine.pooling.pooler import Pooler
from tokenmill.engine.sample import prompt_logprobs
from tokenmill.engine.sample.logit_controls import LogitControls
from tokenmill.engine.sample.sampler import Sampler, SamplingBatch
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.profiling import NO_PROFILER, StepProfiler
from tokenmill.engine.worker.attention import (
    AttentionSpec,
    StepTokens,
    backend_named,
    select_backend,
)
from tokenmill.engine.worker.attention.backend import staged, upload
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs
from tokenmill.engine.worker.host_memory import keep_large_allocations_mapped
from tokenmill.engine.worker.kv_cache import KVCache
from tokenmill.engine.worker.vision_inputs import VisionInputs


class ModelRunner:
    """Args:
    model: the loaded model.
    config: its ModelConfig.
    kv_cache: the allocated cache, in blocks of `engine_config.block_size` positions.
    engine_config: the engine's settings (block_size, seed, max_num_seqs, cuda_graphs,
        max_loras).
    max_model_len: the longest sequence it serves.
    pooler: pools the prompt-only requests that ask for it (None: the model serves no
        pooling task).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        kv_cache: KVCache,
        engine_config: EngineConfig,
        *,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        pooler: Pooler | None = None,
    ) -> None:
        block_size = engine_config.block_size
        self.model = model
        # Pools the prompt-only requests that ask for it (pooling/pooler.py); None when
        # the model serves no pooling task.
        self.pooler = pooler
        self.config = config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        model.attach_rotary(max_model_len, device)
        self.sampler = Sampler(engine_config.seed, device)
        self.kv_cache = kv_cache
        if device.type == "cpu":
            keep_large_allocations_mapped()
        self.attention_spec = AttentionSpec.of_model(
            config, kv_cache.format, block_size=block_size, dtype=dtype, device=device
        )
        self.attention = select_backend(self.attention_spec)
        self.profiler: StepProfiler = NO_PROFILER  # tools install one: engine/types/profiling.py
        for layer_idx, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = kv_cache.k[layer_idx]
            layer.self_attn.v_cache = kv_cache.v[layer_idx]
        # LoRA adapters (lora/manager.py); the model is unchanged until one is registered.
        self.lora = LoRAManager(
            model, config, max_loras=engine_config.max_loras, dtype=dtype, device=device
        )
        # A model with a vision tower: the step's image tokens and their attention.
        self.vision: VisionInputs | None = None
        if hasattr(model, "encode_images") or hasattr(model, "encode_image_list"):
            self.vision = VisionInputs(
                model, block_size=block_size, device=device, dtype=dtype, pair_layout=False
            )
            self._track_cache_layout()
        # Mixture of experts on the CPU: the experts each step's layers ran (its
        # StepResult's num_experts_used); None elsewhere (models/moe.py ExpertUsage).
        self.expert_usage = track_expert_usage(model, device)
        self.decode_graphs = None
        cuda_graphs = engine_config.cuda_graphs
        # 3D positions (M-RoPE, core/mrope.py) are computed per step on the host; the
        # captured decode graphs take 1D positions, so such a model decodes eagerly.
        # (An explicit cuda_graphs=True is refused before loading: worker/build.py.)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        if self.uses_mrope:
            cuda_graphs = False
        if cuda_graphs or (cuda_graphs is None and self.attention.supports_cuda_graphs):
            if not self.attention.supports_cuda_graphs:
                raise ValueError("cuda_graphs needs a CUDA device with Triton installed")
            self.decode_graphs = DecodeGraphs(self, engine_config.seq_cap, max_model_len)

    def use_attention_backend(self, name: str) -> None:
        """Attend through the backend called `name` from now on, whatever it says it
        supports: for tests and benchmarks that compare backends on one model."""
        self.attention = backend_named(name)(self.attention_spec)
        self._track_cache_layout()

    def _track_cache_layout(self) -> None:
        """Tell the image attention whether the cache is in the native pair layout."""
        if self.vision is not None:
            spec = self.attention_spec
            self.vision.pair_layout = self.attention.owns_cache_layout and stores_pairs(
                spec.dtype, spec.block_size, spec.head_dim
            )

    def execute(self, out: SchedulerOutput, previous: PendingStep | None) -> StepResult:
        """Run one scheduled step (`core.step.StepRunner`): build the sampling batch of the
        chunks that sample - their settings, bans, logit controls and grammar masks, the
        masks filling while the model runs - then compute and sample."""
        seqs = [c.seq for c in out.chunks if c.samples]
        batch = None
        if seqs:
            with self.profiler.stage("prepare"):
                batch = self._sampling_batch(seqs, out, previous)
        usage = self.expert_usage
        if usage is not None:
            usage.take()  # forwards outside steps (warm-up) are no step's
        sampled = self.run(out, batch, previous=previous)
        result = StepResult(sampled)
        if usage is not None:
            result.num_experts_used = usage.take()
        masks = batch.token_bitmask if batch is not None else None
        if masks is not None:
            result.num_constrained_tokens = len(masks.rows)
            result.grammar_fill_s = masks.fill_s
            result.grammar_blocking_s = masks.blocking_s
        return result

    def _sampling_batch(
        self, seqs: list[Sequence], out: SchedulerOutput, previous: PendingStep | None
    ) -> SamplingBatch:
        matchers = [seq.grammar for seq in seqs]
        has_grammar = any(m is not None for m in matchers)
        return SamplingBatch.build(
            [s.params for s in seqs],
            [s.generator for s in seqs],
            out.banned_token_ids,
            self.device,
            TokenBitmask(matchers, self.config.vocab_size) if has_grammar else None,
            LogitControls.build(
                seqs,
                out.conditional_bans or [[] for _ in seqs],
                self.device,
                previous.device_token_ids if previous is not None else None,
            ),
        )

    @torch.inference_mode()
    def run(
        self,
        out: SchedulerOutput,
        sampling: SamplingBatch | None,
        *,
        previous: PendingStep | None = None,
    ) -> SamplerOutput | None:
        """Compute the step's tokens; return one sampled token per sampling chunk, in the
        order of out.chunks (None when no chunk samples). On CUDA nothing here waits for
        the device: the returned tensors are filled as the step runs.

        Args:
            previous: the step launched before this one, whose sampled tokens some of this
                step's inputs still are (placeholders); they are read on the device.
        """
        profiler = self.profiler
        prompt_spans = prompt_logprobs.spans_for_step(out.chunks)
        pools = self.pooler is not None and any(c.seq.pooling is not None for c in out.chunks)
        graphs = self.decode_graphs
        # Graphs were captured without adapters: a step with adapter rows runs eagerly.
        uses_lora = self.lora.begin_step(out)
        rope_variants = self.rope_variants(out)
        try:
            images = None
            with_images = self.vision is not None and _computes_images(out)
            if (
                graphs is not None
                and not with_images
                and not prompt_spans
                and not pools
                and not uses_lora
                and rope_variants is None
                and graphs.can_run(out)
            ):
                with profiler.stage("forward"):
                    hidden, sample_rows = graphs.run(out, previous)
            else:
                with profiler.stage("prepare"):
                    input_ids, positions, meta, sample_rows = self.prepare(out, previous)
                with profiler.stage("forward"):
                    if with_images:  # the tower runs here, in stages of its own
                        meta, images = self.vision.step(out, meta, profiler)
                    meta = profiler.attention(meta)
                    hidden = self.forward_model(
                        input_ids, positions, meta, images, rope_variants, self.mrope_positions(out)
                    )
        finally:
            self.lora.end_step()
        with profiler.stage("logits"):
            if prompt_spans:  # a pooling-only model has no compute_logits
                prompt_logprobs.record(prompt_spans, hidden, self.model.compute_logits)
            if pools:
                self.pooler.record_step(out.chunks, hidden)
            if not sample_rows:
                return None
            rows = upload(np.asarray(sample_rows), self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        with profiler.stage("sample"):
            return self.sampler(logits, sampling)

    def step_tokens(self, out: SchedulerOutput) -> StepTokens:
        """The step's tokens flattened, chunk by chunk (decodes first): what every
        attention path's inputs are built from. Decode chunks - most chunks of most steps,
        one token each - are handled with plain ints; numpy only pays off for longer ones."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: dict[int, int] = {}  # id(chunk) -> its first token's row in the batch
        tables: list[list[int]] = []
        placeholder_rows: list[int] = []
        previous_rows: list[int] = []
        for row, chunk in enumerate(out.decodes):
            seq = chunk.seq
            pos = seq.num_computed_tokens
            offsets[id(chunk)] = row
            token_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            tables.append(seq.block_table)
            if seq.num_pending_tokens and pos + 1 == seq.num_tokens:
                # Its token is the previous step's sample, still on the device.
                placeholder_rows.append(row)
                previous_rows.append(seq.pending_row)
        chunk_positions, chunk_slots = (
            [np.asarray(positions, dtype=np.int64)],
            [np.asarray(slots, dtype=np.int64)],
        )
        for chunk in out.prefills:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            offsets[id(chunk)] = len(token_ids)
            token_ids.extend(seq.token_ids[start:end])
            if seq.num_pending_tokens and end == seq.num_tokens:
                placeholder_rows.append(len(token_ids) - 1)
                previous_rows.append(seq.pending_row)
            pos = np.arange(start, end)
            chunk_positions.append(pos)
            chunk_slots.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
            tables.append(seq.block_table)
        return StepTokens(
            token_ids=np.asarray(token_ids, dtype=np.int64),
            positions=np.concatenate(chunk_positions),
            slots=np.concatenate(chunk_slots),
            offsets=offsets,
            tables=tables,
            # Sampled rows in the order of out.chunks, whatever order the tokens went in.
            sample_rows=[offsets[id(c)] + c.num_new_tokens - 1 for c in out.chunks if c.samples],
            placeholder_rows=placeholder_rows,
            previous_rows=previous_rows,
        )

    def fill_placeholders(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        previous_rows: torch.Tensor,
        previous: PendingStep | None,
    ) -> None:
        """input_ids[rows] = the previous step's sampled ids at previous_rows, on the device."""
        if previous is None:
            raise RuntimeError("a placeholder token without the step that samples it")
        input_ids[rows] = previous.device_token_ids[previous_rows]

    def forward_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepAttention,
        images: StepImages | None = None,
        rope_variants: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model over a flat batch: input_ids, positions [num_tokens] -> hidden states
        (images: the step's image soft tokens, for a model with a vision tower;
        rope_variants: see `rope_variants`; mrope_positions: see `mrope_positions`)."""
        extra = {} if rope_variants is None else {"rope_variants": rope_variants}
        if mrope_positions is not None:
            extra["mrope_positions"] = mrope_positions
        if images is None:
            return self.model(input_ids, positions, meta, **extra)
        return self.model(input_ids, positions, meta, images, **extra)

    def mrope_positions(self, out: SchedulerOutput) -> torch.Tensor | None:
        """[3, num_tokens] each token's (time, row, column) positions in step_tokens'
        order (decodes first), for a model with M-RoPE; else None. They follow from
        each token's index and its sequence's images (core/mrope.py), so a decode step,
        a recomputed prompt and a prefix-cache hit all place them alike."""
        if not self.uses_mrope:
            return None
        # A one-token chunk past the prompt's last image (a decode, mostly) is at its
        # index plus the delta on all three: one row built for all of them, since a
        # numpy call per chunk would cost more than the step's other host work at large
        # batches. One still before or inside an image (a prompt's last token after a
        # prefix hit, say) is computed in full.
        singles = [c.seq.num_computed_tokens + mrope_delta(c.seq.images) for c in out.decodes]
        decodes = np.array([singles] * 3, dtype=np.int64).reshape(3, len(singles))
        for i, chunk in enumerate(out.decodes):
            seq = chunk.seq
            start = seq.num_computed_tokens
            if seq.images and seq.images[-1].end > start:
                decodes[:, i] = mrope_positions(seq.images, start, start + 1)[:, 0]
        parts = [decodes]
        for chunk in out.prefills:
            seq = chunk.seq
            start = seq.num_computed_tokens
            parts.append(mrope_positions(seq.images, start, start + chunk.num_new_tokens))
        return upload(np.concatenate(parts, axis=1), self.device)

    def rope_variants(self, out: SchedulerOutput) -> torch.Tensor | None:
        """[num_tokens] each token's sequence's rope variant, in step_tokens' order
        (decodes first), where some sequence of the step runs one other than 0
        (models/rope.py); else None."""
        chunks = out.decodes + out.prefills
        if not any(c.seq.rope_variant for c in chunks):
            return None
        variants = np.repeat(
            [c.seq.rope_variant for c in chunks], [c.num_new_tokens for c in chunks]
        )
        return upload(variants.astype(np.int64), self.device)

    def prepare(
        self, out: SchedulerOutput, previous: PendingStep | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, StepAttention, list[int]]:
        """The step's inputs on the device: (token ids, positions, the attention backend's
        metadata, the rows to sample)."""
        step = self.step_tokens(out)
        input_ids = upload(step.token_ids, self.device)
        if step.placeholder_rows:
            self.fill_placeholders(
                input_ids,
                upload(np.asarray(step.placeholder_rows), self.device),
                upload(np.asarray(step.previous_rows), self.device),
                previous,
            )
        meta = self.attention.build(step, out)
        return input_ids, upload(step.positions, self.device), meta, step.sample_rows

    def staged(self, array: np.ndarray) -> torch.Tensor:
        """array as an int64 host tensor to upload from (pinned on CUDA)."""
        return staged(array, self.device)


def _computes_images(out: SchedulerOutput) -> bool:
    """Whether some chunk of the step computes a token of an image."""
    for chunk in out.chunks:
        start = chunk.seq.num_computed_tokens
        end = start + chunk.num_new_tokens
        if any(i.offset < end and i.end > start for i in chunk.seq.images):
            return True
    return False
