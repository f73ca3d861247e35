"""`LLM`: the offline entry point - load a model once, generate for many prompts."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tokenmill.engine.config import EngineConfig, resolve_dtype
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.loader.hub import snapshot_revision
from tokenmill.engine.loader.model_files import display_name, resolve_model
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.outputs import EngineStats, RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.worker.build import build_runner

Prompt = str | list[int]


class LLM:
    """A model loaded for batch generation.

    Args:
        model: an HF-layout directory, a .gguf file, an alias, or a Hugging Face Hub repo
            id ("org/name", fetched into the HF cache); None = the default model
            (`model_files.DEFAULT_MODEL`).
        revision: branch, tag or commit of a Hub repo id (default "main"); the commit it
            resolved to is `model_revision`.
        dtype: "auto" (bf16 on CUDA and on CPUs with native bf16, else fp32),
            "float32", "bfloat16" or a torch dtype.
        device: "cpu", "cuda", "cuda:N"; None = CUDA when available.
        enable_prefix_caching: share computed prompt blocks between requests.
        kv_cache_memory: KV cache budget in bytes (None = sized from the device).
        kv_cache_dtype: "auto" (keys and values in `dtype`) or "int8" (int8 with a scale
            per 32 values: 1.8x the tokens of a bf16 cache in the same memory, and less to
            read per decode step; CPU only).
        block_size, max_num_batched_tokens, max_num_seqs, max_model_len, seed,
            overlap_steps, cuda_graphs: see EngineConfig (the last two default to on
            for CUDA devices).
        quantization: None (the weights in `dtype`), "int8" (int8 weights and
            activations), "int4" (group-wise 4-bit weights) or "gguf" (a GGUF model's
            own quantized blocks); CPU only. The rest of the model runs in `dtype`.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        revision: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_memory: int | None = None,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
        quantization: str | None = None,
        overlap_steps: bool | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        # Validated (quantization and kv_cache_dtype names included) before a model is
        # looked up or converted.
        self.engine_config = EngineConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            quantization=quantization,
            overlap_steps=overlap_steps,
            cuda_graphs=cuda_graphs,
        )
        self.model_dir = resolve_model(model, revision=revision)
        # The Hub commit the weights came from (None for local files and aliases).
        self.model_revision = snapshot_revision(self.model_dir)
        self.model_name = display_name(model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.engine = build_engine(
            self.model_dir,
            self.engine_config,
            dtype=self.dtype,
            device=self.device,
            tokenizer=self.tokenizer,
        )
        self.model_config = self.engine.runner.config
        self.max_model_len = self.engine.max_model_len
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched continuously.

        Args:
            prompts: strings (tokenized here) or token-id lists, or one of either.
            sampling_params: one for all prompts, or one per prompt; None = defaults.
            on_output: called with each RequestOutput as its request finishes.
            on_step: called after each engine step with the engine's cumulative
                EngineStats (the same object, updated in place): progress per token.
                An exception it raises ends the call as a failed step does.
        Returns:
            One RequestOutput per prompt, in input order. A prompt the engine cannot
            serve comes back with finish_reason "error" and .error set.
            If a step raises, every request of this call is dropped (`abort_all`) and
            the error propagates; the LLM stays usable.

        Raises:
            ValueError: a structured outputs constraint is invalid or cannot be enforced
                (raised before any prompt is queued).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt_params(sampling_params, len(prompts))
        for constraint in {p.structured_outputs for p in params} - {None}:
            self.engine.compile_structured_outputs(constraint)
        texts = [p if isinstance(p, str) else None for p in prompts]
        to_encode = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self.tokenizer.encode_batch(to_encode) if to_encode else [])
        ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

        request_ids = [str(next(self._request_counter)) for _ in prompts]
        position = {rid: i for i, rid in enumerate(request_ids)}
        for rid, prompt_ids, text, p in zip(request_ids, ids, texts, params):
            self.engine.add_request(rid, prompt_ids, p, prompt=text)
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            while self.engine.has_unfinished:
                for output in self.engine.step():
                    results[position[output.request_id]] = output
                    if on_output is not None:
                        on_output(output)
                if on_step is not None:
                    on_step(self.engine.stats)
        except BaseException:
            # A failed step (or an interrupt) must not leave these requests queued for
            # the next call: the engine is reset and the error goes to the caller.
            self.engine.abort_all()
            raise
        return results

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # The template already carries any BOS; encode without adding special tokens.
        ids = self.tokenizer.encode_batch(prompts, add_special_tokens=False)
        outputs = self.generate(ids, sampling_params, on_output=on_output, on_step=on_step)
        for output, text in zip(outputs, prompts):
            output.prompt = text
        return outputs

    def stats(self) -> EngineStats:
        """Cumulative counters: computed/cached prompt tokens, generated tokens, preemptions."""
        return self.engine.stats


def build_engine(
    model_dir: Path,
    engine_config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: Tokenizer | None = None,
) -> LLMEngine:
    """The engine loop over a runner loaded from model_dir (what `LLM` builds).

    Args:
        model_dir: an HF-layout model directory.
        engine_config: the engine's settings.
        dtype, device: where and in what the model runs.
        tokenizer: decodes outputs and stop strings (None: token ids only).
    """
    loaded = build_runner(model_dir, engine_config, dtype=dtype, device=device)
    return LLMEngine(
        loaded.runner,
        engine_config,
        tokenizer,
        num_blocks=loaded.num_blocks,
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.model_config.vocab_size,
        eos_token_ids=loaded.model_config.eos_token_ids,
    )


def _per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    return params
