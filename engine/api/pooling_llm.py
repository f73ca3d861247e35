"""`LLM`'s pooling methods - embed, classify, score (rerank) and encode - in vLLM's shape.

Mixed into `LLM` (engine/api/llm.py), which owns the engine, the tokenizer and the model's
served tasks. An encoder (BERT family) runs in its own loop (`core/encoder_engine.py`);
a decoder pools through the decode loop as prompt-only requests, so the prefix cache
shares common prefixes (an instruction prefix before every query) exactly as it does
for generation.

Texts are tokenized as sentence-transformers tokenizes them: lowercased when the model
says `do_lower_case`, cut to its `max_seq_length` (each output says whether its text
was cut: `truncated`), or refused one by one with `truncate=False`. An empty string is
embedded as the tokenizer encodes it (BERT: "[CLS] [SEP]"), as sentence-transformers
does; a prompt that encodes to no token at all comes back as an error output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

from tokenmill.engine.api.request_loop import per_prompt, run_to_completion
from tokenmill.engine.core.encoder_engine import EncoderEngine
from tokenmill.engine.loader.pooling_tokenizer import EncodedText, PoolingTokenizer
from tokenmill.engine.models import architecture_for
from tokenmill.engine.pooling.config import PoolingConfig, read_pooling_config
from tokenmill.engine.types.outputs import EngineStats, RequestMetrics
from tokenmill.engine.types.pooling_outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingOutput,
    ScoringOutput,
    task_view,
)
from tokenmill.engine.types.pooling_params import CLASSIFY, EMBED, RERANK, PoolingParams
from tokenmill.engine.types.sampling_params import SamplingParams

OnPooled = Callable[[PoolingOutput], None]


class PoolingMethods:
    """embed / classify / score / encode for `LLM` (which sets engine, tokenizer, tasks,
    model_dir, max_model_len and _request_counter)."""

    engine: Any
    tokenizer: Any
    tasks: tuple[str, ...]
    model_dir: Any
    max_model_len: int
    _request_counter: Any

    @cached_property
    def pooling_config(self) -> PoolingConfig:
        """How the model pools (sentence-transformers' files, or its kind's default)."""
        is_encoder = architecture_for(self.engine.runner.config).is_encoder
        return read_pooling_config(self.model_dir, is_encoder=is_encoder)

    @cached_property
    def pooling_tokenizer(self) -> PoolingTokenizer:
        """Encodes texts for pooling: cut to max_seq_length, lowercased if the model says."""
        limit = self.max_model_len
        if self.pooling_config.max_seq_length:
            limit = min(limit, self.pooling_config.max_seq_length)
        return PoolingTokenizer(
            self.tokenizer, max_length=limit, lowercase=self.pooling_config.lowercase
        )

    @property
    def embedding_size(self) -> int | None:
        """Values in the model's embedding (before `dimensions`); None if it cannot embed."""
        pooler = getattr(self.engine.runner, "pooler", None)
        return pooler.embedding_size if pooler is not None and EMBED in self.tasks else None

    @property
    def label_names(self) -> tuple[str, ...]:
        """The classification head's labels, in the order of `probs` (config id2label)."""
        return self.pooling_config.labels

    def embed(
        self,
        texts: str | Sequence[str],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        truncate: bool = True,
        on_output: OnPooled | None = None,
        allow_special_tokens: bool = False,
    ) -> list[EmbeddingOutput]:
        """Embed every text; outputs in input order, each with `.embedding`.

        Args:
            texts: one text or many.
            dimensions: keep the first n values and normalise again (Matryoshka models).
            normalize: unit-normalise (None: as the model's modules say).
            prompt_name: put the model's named prompt before each text (its
                config_sentence_transformers.json `prompts`, e.g. "query"); default:
                its default_prompt_name, if any.
            prompt: put this text before each text instead.
            truncate: cut texts longer than max_seq_length (False: they fail alone).
            on_output: called with each output as it finishes.
            allow_special_tokens: encode special-token strings in the texts as the tokens
                they name (by default a text is data: they are plain text).

        Raises:
            ValueError: the model does not embed, dimensions is too large, or an
                unknown prompt_name.
        """
        params = PoolingParams(EMBED, dimensions=dimensions, normalize=normalize)
        prefix = self.prompt_prefix(prompt_name, prompt)
        texts = [texts] if isinstance(texts, str) else list(texts)
        _check_texts(texts, "texts")
        encoded = self.pooling_tokenizer.encode(
            [prefix + t for t in texts],
            truncate=truncate,
            data_spans=self._data_spans(texts, allow_special_tokens, after=len(prefix)),
        )
        return self._run_encoded(encoded, params, texts, on_output)

    def classify(
        self,
        texts: str | Sequence[str],
        *,
        truncate: bool = True,
        on_output: OnPooled | None = None,
        allow_special_tokens: bool = False,
    ) -> list[ClassificationOutput]:
        """Classify every text; outputs in input order, each with `.probs` (one per
        `label_names` entry) and `.label` (special-token strings as for `embed`)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        _check_texts(texts, "texts")
        encoded = self.pooling_tokenizer.encode(
            texts, truncate=truncate, data_spans=self._data_spans(texts, allow_special_tokens)
        )
        return self._run_encoded(encoded, PoolingParams(CLASSIFY), texts, on_output)

    def score(
        self,
        queries: str | Sequence[str],
        documents: str | Sequence[str],
        *,
        truncate: bool = True,
        on_output: OnPooled | None = None,
        allow_special_tokens: bool = False,
    ) -> list[ScoringOutput]:
        """Score (query, document) pairs with a cross-encoder; outputs with `.score`.

        One query (or one document) is paired with every document (query); otherwise
        the two lists pair up one to one. Special-token strings as for `embed`.
        """
        queries = [queries] if isinstance(queries, str) else list(queries)
        documents = [documents] if isinstance(documents, str) else list(documents)
        if len(queries) == 1 and len(documents) != 1:
            queries = queries * len(documents)
        elif len(documents) == 1 and len(queries) != 1:
            documents = documents * len(queries)
        _check_texts(queries, "queries")
        _check_texts(documents, "documents")
        encoded = self.pooling_tokenizer.encode_pairs(
            queries,
            documents,
            truncate=truncate,
            query_spans=self._data_spans(queries, allow_special_tokens),
            document_spans=self._data_spans(documents, allow_special_tokens),
        )
        return self._run_encoded(encoded, PoolingParams(RERANK), None, on_output)

    def encode(
        self,
        prompts: Sequence[Sequence[int]],
        params: PoolingParams | Sequence[PoolingParams],
        *,
        on_output: OnPooled | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> list[PoolingOutput]:
        """Pool token-id prompts (tokenized already, e.g. by a job's planner).

        Args:
            prompts: one token-id list per request; a rerank request's is a pair laid
                out by the tokenizer's pair template (`loader/pooling_tokenizer.py`).
            params: one for all, or one per prompt.
            on_output: called with each output as it finishes.
            on_step: called after each engine step with the engine's cumulative stats
                (as `LLM.generate`'s: a dry run's calibration times the steps).

        Returns:
            One PoolingOutput per prompt, in input order; a prompt the model cannot
            serve (too long, empty) comes back with `error` set.

        Raises:
            ValueError: the model does not serve a requested task (before any prompt
                is queued).
        """
        prompts = list(prompts)
        per_prompt_params = per_prompt(params, PoolingParams, len(prompts), "pooling params")
        for p in set(per_prompt_params):
            self._check_pooling(p)
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        for rid, ids, p in zip(request_ids, prompts, per_prompt_params):
            self._add_pooling_request(rid, list(ids), p)
        return run_to_completion(self.engine, request_ids, on_output=on_output, on_step=on_step)

    # -- helpers ----------------------------------------------------------------------------

    def _data_spans(self, texts: list[str], allow: bool, *, after: int = 0) -> list | None:
        """Each text's special-token strings, which are data (None when allowed as
        tokens), as spans `after` characters on (a prompt put before the text)."""
        if allow:
            return None
        find = self.tokenizer.special_text.find
        return [tuple((start + after, end + after) for start, end in find(t)) for t in texts]

    def _check_pooling(self, params: PoolingParams) -> None:
        if params.task not in self.tasks:
            raise ValueError(
                f"this model serves {', '.join(self.tasks)}, not {params.task} "
                f"({_task_hint(params.task)})"
            )
        pooler = getattr(self.engine.runner, "pooler", None)
        problem = pooler.unsupported(params) if pooler is not None else "it has no pooling"
        if problem is not None:
            raise ValueError(problem)

    def _add_pooling_request(self, request_id: str, ids: list[int], params: PoolingParams):
        if isinstance(self.engine, EncoderEngine):
            self.engine.add_request(request_id, ids, params)
        else:
            state = self.engine.runner.pooler.state_for(params)
            self.engine.add_request(request_id, ids, SamplingParams(), pooling=state)

    def _run_encoded(
        self,
        encoded: list[EncodedText],
        params: PoolingParams,
        texts: list[str] | None,
        on_output: OnPooled | None,
    ) -> list:
        self._check_pooling(params)
        good = [i for i, e in enumerate(encoded) if e.token_ids is not None]
        outputs = self.encode([encoded[i].token_ids for i in good], params, on_output=on_output)
        results: list[PoolingOutput] = [None] * len(encoded)
        for i, output in zip(good, outputs):
            output.truncated = encoded[i].truncated
            results[i] = output
        for i, e in enumerate(encoded):
            if e.token_ids is None:
                now = time.perf_counter()
                results[i] = PoolingOutput(
                    request_id=str(next(self._request_counter)),
                    prompt=None,
                    prompt_token_ids=[],
                    task=params.task,
                    data=None,
                    prompt_tokens=0,
                    cached_tokens=0,
                    metrics=RequestMetrics(arrival_time=now, finish_time=now),
                    error=e.error,
                )
        labels = self.label_names if params.task == CLASSIFY else ()
        views = []
        for i, output in enumerate(results):
            output.prompt = texts[i] if texts is not None else None
            output.label_names = labels
            views.append(task_view(output))
        return views

    def prompt_prefix(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text put before each text to embed: `prompt`, else the model's prompt called
        `prompt_name` (else its default prompt name), else nothing.

        Raises:
            ValueError: both given, or the model has no prompt of that name.
        """
        if prompt is not None and prompt_name is not None:
            raise ValueError("give prompt or prompt_name, not both")
        if prompt is not None:
            return prompt
        config = self.pooling_config
        name = prompt_name or config.default_prompt_name
        if name is None:
            return ""
        if name not in config.prompts:
            known = ", ".join(config.prompts) or "none"
            raise ValueError(f"the model has no prompt named {name!r} (its prompts: {known})")
        return config.prompts[name]


def _check_texts(texts: list, what: str) -> None:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{what}[{i}] must be a string, got {type(text).__name__}")


def _task_hint(task: str) -> str:
    return {
        EMBED: "an embedding model: a sentence-transformers directory or an encoder",
        CLASSIFY: "a *ForSequenceClassification model",
        RERANK: "a cross-encoder: a one-label *ForSequenceClassification model",
    }.get(task, "")
