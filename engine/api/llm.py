"""`LLM`: the offline entry point - load a model once, generate for many prompts."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.api.image_layouts import check_pan_and_scan
from tokenmill.engine.api.image_prompts import (
    ImagePrompts,
    PreparedPrompt,
    check_prompt_dict,
    has_image_parts,
    split_image_parts,
)
from tokenmill.engine.api.plan import Plan, loaded_or_not, plan_requests
from tokenmill.engine.api.pooling_llm import PoolingMethods
from tokenmill.engine.api.qwen_image_prompts import QwenImagePrompts
from tokenmill.engine.api.reasoning import (
    REASONING_EFFORTS,
    reasons_apart_with_effort,
    split_reasoning_of,
)
from tokenmill.engine.api.request_loop import per_prompt, run_to_completion
from tokenmill.engine.core.encoder_engine import EncoderEngine
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.simulation import PlannedRequest
from tokenmill.engine.loader.hub import snapshot_revision
from tokenmill.engine.loader.model_files import display_name, resolve_model
from tokenmill.engine.loader.pooling_tokenizer import pair_separator_id
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.lora.adapters import describe_adapter, model_names
from tokenmill.engine.models import GENERATE, load_config
from tokenmill.engine.pooling.config import served_tasks
from tokenmill.engine.types.config import EngineConfig, engine_settings, resolve_dtype
from tokenmill.engine.types.lora_request import LoRARequest
from tokenmill.engine.types.memory import MemoryPlan
from tokenmill.engine.types.outputs import EngineStats, RequestOutput
from tokenmill.engine.types.profiling import NO_PROFILER, StepProfiler
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.start_phases import StartPhases
from tokenmill.engine.worker.build import (
    build_encoder_runner,
    build_runner,
    check_settings,
    is_encoder_dir,
)

# A string, token ids, or vLLM's dict ({"prompt" | "prompt_token_ids", "multi_modal_data"}).
Prompt = str | list[int] | dict
LoRARequests = LoRARequest | Sequence[LoRARequest | None] | None


class LLM(PoolingMethods):
    """A model loaded for batch generation - or for embedding, classification and
    reranking (`embed`, `classify`, `score`, `encode`: engine/api/pooling_llm.py), as its
    architecture serves (`tasks`).

    Args:
        model: an HF-layout directory, a .gguf file, an alias, or a Hugging Face Hub repo
            id ("org/name", fetched into the HF cache); None = the default model
            (`loader.aliases.DEFAULT_MODEL`).
        revision: branch, tag or commit of a Hub repo id (default "main"); the commit it
            resolved to is `model_revision`.
        **settings: engine settings, each a field of `EngineConfig` (listed below, and
            in this signature).

    Raises:
        TypeError: a keyword that is not an engine setting.
        ValueError: a setting's value is invalid or cannot run here (before the model is
            looked up, converted or loaded).
    """

    def __init__(
        self, model: str | Path | None = None, *, revision: str | None = None, **settings: Any
    ) -> None:
        unknown = sorted(set(settings) - {f.name for f in engine_settings()})
        if unknown:
            raise TypeError(
                f"LLM() got unknown engine settings {', '.join(map(repr, unknown))}; "
                f"settings: {', '.join(f.name for f in engine_settings())}"
            )
        self.engine_config = EngineConfig(**settings)
        check_settings(self.engine_config)
        phases = StartPhases()
        self.model_dir = resolve_model(model, revision=revision)
        if self.engine_config.pan_and_scan:  # refused by name before the weights load
            check_pan_and_scan(load_config(self.model_dir), True)
        # The Hub commit the weights came from (None for local files and aliases).
        self.model_revision = snapshot_revision(self.model_dir)
        self.model_name = display_name(model)
        # What a LoRA adapter's base_model_name_or_path may call this model (None: unknown).
        self.model_names = model_names(model)
        config = self.engine_config
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = resolve_dtype(config.dtype, self.device)
        phases.lap("resolve")
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        phases.lap("tokenizer")
        # What the model can be asked: generate, embed, classify, rerank.
        self.tasks = served_tasks(self.model_dir)
        self.engine = build_engine(
            self.model_dir,
            config,
            dtype=self.dtype,
            device=self.device,
            tokenizer=self.tokenizer,
            phases=phases,
        )
        phases.lap("engine")
        # Wall seconds per phase of this start, in order (types/start_phases.py).
        self.start_phases: dict[str, float] = phases.seconds
        self.model_config = self.engine.runner.config
        self.max_model_len = self.engine.max_model_len
        self._request_counter = itertools.count()
        self._image_prompts: ImagePrompts | None = None  # made on the first image prompt

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequests = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
        allow_special_tokens: bool = False,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched continuously.

        Args:
            prompts: strings (tokenized here) or token-id lists, or one of either. A
                string is data: a special-token string in it (`<|im_start|>`) is encoded
                as plain text; token ids are sent as they are. With images, vLLM's dict
                `{"prompt": str | "prompt_token_ids": ids, "multi_modal_data": {"image":
                image | [images]}}` (images as encoded bytes or PIL images, placed at the
                model's begin-of-image markers: api/image_prompts.py); a bad image makes
                that prompt an error output.
            sampling_params: one for all prompts, or one per prompt; None = defaults.
            lora_request: the LoRA adapter to run with: one for all prompts, or one per
                prompt (None: the base model). Prompts of different adapters share steps;
                each adapter is read once per LLM and checked before anything is queued.
            on_output: called with each RequestOutput as its request finishes.
            on_step: called after each engine step with the engine's cumulative
                EngineStats (the same object, updated in place): progress per token.
                An exception it raises ends the call as a failed step does.
            allow_special_tokens: encode special-token strings in string prompts as the
                control tokens they name (prompts written with the model's markup).
        Returns:
            One RequestOutput per prompt, in input order. A prompt the engine cannot
            serve comes back with finish_reason "error" and .error set.
            If a step raises, every request of this call is dropped (`abort_all`) and
            the error propagates; the LLM stays usable.

        Raises:
            ValueError: a structured outputs constraint is invalid or cannot be enforced,
                or a LoRA adapter is missing or does not fit the model
                (`lora.adapters.AdapterError`, naming it), or the model does not
                generate - raised before any prompt is queued.
        """
        if GENERATE not in self.tasks:
            raise ValueError(
                f"this model serves {', '.join(self.tasks)}, not generate: use "
                "embed, classify or score"
            )
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        prepared = self._prepare_image_prompts(prompts, allow_special_tokens)
        prompts = [p.token_ids if isinstance(p, PreparedPrompt) else p for p in prepared]
        params = _per_prompt_params(sampling_params, len(prompts))
        loras = _per_prompt_loras(lora_request, len(prompts))
        for constraint in {p.structured_outputs for p in params} - {None}:
            self.engine.compile_structured_outputs(constraint)
        lora_ids = {r: self.lora_id(r) for r in dict.fromkeys(loras) if r is not None}
        texts = [
            q.text if isinstance(q, PreparedPrompt) else p if isinstance(p, str) else None
            for p, q in zip(prompts, prepared)
        ]
        to_encode = [p for p in prompts if isinstance(p, str)]
        spans = None
        if not allow_special_tokens:
            spans = [self.tokenizer.special_text.find(p) for p in to_encode]
        encoded = iter(
            self.tokenizer.encode_batch(to_encode, data_spans=spans) if to_encode else []
        )
        ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

        request_ids = [str(next(self._request_counter)) for _ in prompts]
        for rid, prompt_ids, text, p, lora, q in zip(
            request_ids, ids, texts, params, loras, prepared
        ):
            lora_id = lora_ids[lora] if lora is not None else 0
            extra = {}
            if isinstance(q, PreparedPrompt):
                extra = {"images": q.images, "input_error": q.error}
            self.engine.add_request(rid, prompt_ids, p, prompt=text, lora_id=lora_id, **extra)

        def with_adapter(index: int, output: RequestOutput) -> None:
            output.lora_request = loras[index]

        return run_to_completion(
            self.engine,
            request_ids,
            on_output=on_output,
            on_step=on_step,
            annotate=with_adapter,
        )

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        lora_request: LoRARequests = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
        allow_special_tokens: bool = False,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate (with
        `lora_request` as for `generate`).

        Special-token strings in the messages are data, encoded as plain text: only the
        template's own markup becomes control tokens, unless `allow_special_tokens`.

        A model whose template has its answers reason apart (gpt-oss, Qwen3) gets each
        completion split: its reasoning in `reasoning_content`, the final answer in
        `text` (api/reasoning.py). `reasoning_effort` ("low", "medium", "high") goes to
        a template that reads it (gpt-oss's); any other refuses it.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if reasoning_effort is not None:
            if not reasons_apart_with_effort(self.tokenizer):
                raise ValueError(
                    "reasoning_effort is given but this model's chat template does not read it"
                )
            if reasoning_effort not in REASONING_EFFORTS:
                raise ValueError(
                    f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                    f"not {reasoning_effort!r}"
                )
        if any(has_image_parts(c) for c in conversations):
            if reasoning_effort is not None:
                raise ValueError("reasoning_effort is not passed with images yet")
            outputs = self._chat_with_images(
                conversations,
                sampling_params,
                add_generation_prompt=add_generation_prompt,
                lora_request=lora_request,
                on_output=on_output,
                on_step=on_step,
                allow_special_tokens=allow_special_tokens,
            )
            split_reasoning_of(self.tokenizer, outputs)
            return outputs
        variables = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
        rendered = [
            self.tokenizer.render_chat(
                c,
                add_generation_prompt=add_generation_prompt,
                allow_special_tokens=allow_special_tokens,
                **variables,
            )
            for c in conversations
        ]
        prompts = [text for text, _ in rendered]
        # The template already carries any BOS; encode without adding special tokens.
        ids = self.tokenizer.encode_batch(
            prompts, add_special_tokens=False, data_spans=[spans for _, spans in rendered]
        )
        outputs = self.generate(
            ids,
            sampling_params,
            lora_request=lora_request,
            on_output=on_output,
            on_step=on_step,
        )
        for output, text in zip(outputs, prompts):
            output.prompt = text
        split_reasoning_of(self.tokenizer, outputs)
        return outputs

    def _chat_with_images(
        self,
        conversations,
        sampling_params,
        *,
        add_generation_prompt,
        allow_special_tokens,
        **generate_args,
    ) -> list[RequestOutput]:
        """`chat` for conversations with OpenAI image_url parts (base64 data: URLs):
        each image placed where the template puts its begin-of-image marker."""
        if getattr(self.model_config, "vision", None) is None:
            raise ValueError("this model has no vision tower: it cannot take image_url parts")
        image_prompts = self._image_prompts_of_model()
        prepared, texts = [], []
        for conversation in conversations:
            messages, images, error = split_image_parts(conversation)
            text, spans = self.tokenizer.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                allow_special_tokens=allow_special_tokens,
                image_parts=True,
            )
            texts.append(text)
            if error is not None:
                prepared.append(PreparedPrompt([], text=text, error=error))
            else:
                prepared.append(image_prompts.prepare_rendered(text, spans, images))
        outputs = self.generate(prepared, sampling_params, **generate_args)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def _image_prompts_of_model(self) -> ImagePrompts:
        if self._image_prompts is None:
            # A model with 3D positions (Qwen2.5-VL) takes images at their own sizes.
            config = self.engine_config
            if hasattr(self.model_config, "mrope_section"):
                self._image_prompts = QwenImagePrompts(
                    self.model_dir,
                    self.model_config,
                    self.tokenizer,
                    max_image_pixels=config.max_image_pixels,
                )
            else:
                self._image_prompts = ImagePrompts(
                    self.model_dir,
                    self.model_config,
                    self.tokenizer,
                    max_image_pixels=config.max_image_pixels,
                    pan_and_scan=config.pan_and_scan,
                )
        return self._image_prompts

    def _prepare_image_prompts(self, prompts: list, allow_special_tokens: bool) -> list:
        """Each prompt dict (vLLM's, with multi_modal_data) as a PreparedPrompt; other
        prompts as they are. Raises before anything is queued on a malformed dict, or
        images given to a model without a vision tower."""
        if not any(isinstance(p, dict) for p in prompts):
            return prompts  # strings, ids, and PreparedPrompts (from _chat_with_images)
        has_vision = getattr(self.model_config, "vision", None) is not None
        for p in prompts:
            if isinstance(p, dict):
                check_prompt_dict(p, has_vision)
        prepared = []
        for p in prompts:
            if not isinstance(p, dict):
                prepared.append(p)
            elif has_vision:
                prepared.append(
                    self._image_prompts_of_model().prepare(
                        p, allow_special_tokens=allow_special_tokens
                    )
                )
            elif "prompt" in p:
                prepared.append(p["prompt"])
            else:
                prepared.append(list(p["prompt_token_ids"]))
        return prepared

    def lora_id(self, lora_request: LoRARequest) -> int:
        """The engine's id of an adapter (>= 1), its files checked against this model and
        read on first use; requests with the same files get the same id.

        Raises:
            AdapterError (a ValueError): the adapter is missing, stored only as pickle,
                not a plain LoRA, or does not fit this model; the message names it.
        """
        description = describe_adapter(
            lora_request.name,
            lora_request.path,
            self.model_config,
            revision=lora_request.revision,
            model_names=self.model_names,
            max_rank=self.engine_config.max_lora_rank,
        )
        return self.engine.runner.lora.register(description)

    @loaded_or_not
    def plan(
        self: LLM | None,
        batches: Sequence[Sequence[PlannedRequest]],
        *,
        simulate: bool = False,
        model: str | Path | None = None,
        revision: str | None = None,
        **settings: Any,
    ) -> Plan:
        """What the engine will do with these requests, before computing any: each
        request's cached prompt tokens (the prefix cache replayed over them in order, exact
        where the cache never has to evict) and, with `simulate`, the engine's own loop run
        with each request's `completion_tokens` - its steps, cached tokens and preemptions
        (engine/api/plan.py).

        On a loaded LLM (`llm.plan(batches)`) the plan is of its own engine; on the class
        (`LLM.plan(batches, model=..., **settings)`) of the engine `LLM(model, **settings)`
        would build, sized from the model's files without loading anything.

        Args:
            batches: the requests of each call, in run order (PlannedRequest: token ids,
                params, completion tokens to script).
            simulate: also run the engine's loop over a stand-in model.
            model, revision, settings: the class form's model and engine settings.
        Raises:
            TypeError: settings given to a loaded LLM, or a keyword that is not a setting.
        """
        return plan_requests(
            self, batches, simulate=simulate, model=model, revision=revision, **settings
        )

    def set_profiler(self, profiler: StepProfiler | None) -> None:
        """Report every stage of every step to `profiler` from now on (None: stop); see
        engine/types/profiling.py for the stages and `tokenmill.bench.profile` for a timer."""
        profiler = profiler or NO_PROFILER
        if self.engine.profiler is not profiler:
            self.engine.profiler.watch(None)  # the one replaced lets go of the model
        profiler.watch(self.engine.runner.model)
        self.engine.profiler = profiler
        self.engine.runner.profiler = profiler

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block, so the next requests compute their prompts in
        full: a timed run or a calibration that must start cold. Blocks that running
        requests hold stay theirs; only their reuse by later requests is lost."""
        self.engine.reset_prefix_cache()

    @property
    def memory(self) -> MemoryPlan:
        """The memory the engine was planned to take before its load: weights in its
        dtype, the KV cache, and the RAM that was left (engine/worker/memory.py)."""
        return self.engine.memory

    def stats(self) -> EngineStats:
        """Cumulative counters: computed/cached prompt tokens, generated tokens,
        preemptions, adapters loaded into LoRA slots."""
        lora = getattr(self.engine.runner, "lora", None)  # an encoder's runner has none
        if lora is None:
            return self.engine.stats
        return replace(self.engine.stats, num_adapter_loads=lora.num_slot_loads)


def build_engine(
    model_dir: Path,
    engine_config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: Tokenizer | None = None,
    phases: StartPhases | None = None,
) -> LLMEngine | EncoderEngine:
    """The engine loop over a runner loaded from model_dir (what `LLM` builds): the
    decode loop, or for an encoder the encoder loop.

    Args:
        model_dir: an HF-layout model directory.
        engine_config: the engine's settings.
        dtype, device: where and in what the model runs.
        tokenizer: decodes outputs and stop strings (None: token ids only); an encoder
            reads its pair template.
        phases: where a decoder's load records its phases (worker/build.py's build_runner).
    """
    if is_encoder_dir(model_dir):
        encoder = build_encoder_runner(
            model_dir,
            engine_config,
            dtype=dtype,
            device=device,
            pair_separator_id=pair_separator_id(tokenizer.backend) if tokenizer else None,
        )
        return EncoderEngine(
            encoder.runner,
            engine_config,
            max_model_len=encoder.max_model_len,
            vocab_size=encoder.model_config.vocab_size,
            memory=encoder.memory,
        )
    loaded = build_runner(model_dir, engine_config, dtype=dtype, device=device, phases=phases)
    return LLMEngine(
        loaded.runner,
        engine_config,
        tokenizer,
        num_blocks=loaded.num_blocks,
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.model_config.vocab_size,
        eos_token_ids=loaded.model_config.eos_token_ids,
        memory=loaded.memory,
        rope_variant=loaded.rope_variant,
    )


def _per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    default = SamplingParams() if sampling_params is None else sampling_params
    return per_prompt(default, SamplingParams, num_prompts, "sampling params")


def _per_prompt_loras(lora_request: LoRARequests, num_prompts: int) -> list[LoRARequest | None]:
    loras = per_prompt(lora_request, LoRARequest, num_prompts, "LoRA requests")
    bad = [r for r in loras if r is not None and not isinstance(r, LoRARequest)]
    if bad:
        raise TypeError(f"lora_request entries must be LoRARequest or None, got {bad[0]!r}")
    return loras


def _documented_signature(cls: type) -> None:
    """Give `cls.__init__` the engine settings as keyword-only parameters (help(), IDEs,
    `inspect.signature`) and append each setting's help to the class docstring."""
    init = cls.__init__
    signature = inspect.signature(init)
    own = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    settings = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in engine_settings()
    ]
    init.__signature__ = signature.replace(parameters=[*own, *settings])
    lines = [f"    {f.name}: {f.metadata['help']}" for f in engine_settings()]
    cls.__doc__ = cls.__doc__.rstrip() + "\n\n    Engine settings:\n" + "\n".join(lines) + "\n"


_documented_signature(LLM)
