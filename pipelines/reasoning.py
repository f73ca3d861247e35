"""A chat job's answers split into reasoning and final text, as `LLM.chat` splits them.

Models whose chat template makes them write their reasoning apart (gpt-oss's harmony
analysis channel, Qwen3's `<think>` block; `tokenmill.engine.reasoning_format`) answer a
chat-rendered row with both. A job over such a model decides once, at planning, that its
rows are split: the final answer stays in `output` and the reasoning goes to the
`reasoning_content` result column (`pipelines/results.py`), so every part of the job has
the same schema. Raw jobs (`raw=True`, scoring) and an OpenAI batch file's
/v1/completions lines are not chat answers: nothing of theirs is split.

gpt-oss's markers are special tokens, so its answers are split from their token ids
with the markers kept: decoded with special tokens skipped, the channel words would run
into the text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.connectors import COMPLETIONS_URL
from tokenmill.engine import (
    REASONING_EFFORTS,
    RequestOutput,
    reasoning_format,
    reasons_apart_with_effort,
    split_reasoning_of,
)
from tokenmill.pipelines.scoring import GENERATE


def job_reasoning_format(*, task: str, raw: bool | None, tokenizer: Any) -> str | None:
    """How a job's answers are split: the model's reasoning format when the job sends
    its rows through the chat template to generate; None otherwise (nothing is split)."""
    if task != GENERATE or raw or getattr(tokenizer, "chat_template", None) is None:
        return None
    return reasoning_format(tokenizer)


def check_reasoning_effort(tokenizer: Any, effort: Any) -> None:
    """Raise ValueError naming why `effort` cannot go to this model's chat template: a
    value gpt-oss's template does not know, or a template that does not read it."""
    if not reasons_apart_with_effort(tokenizer):
        raise ValueError(
            "reasoning_effort is given but this model's chat template does not read it"
        )
    if effort not in REASONING_EFFORTS:
        raise ValueError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {effort!r}"
        )


def several_completions_refusal(fmt: str | None) -> str | None:
    """Why a row may not ask for several completions on this job, or None: the
    `reasoning_content` column holds one completion's reasoning (`completions` has no
    reasoning field), so the others' would be lost."""
    if fmt is None:
        return None
    return (
        f"n > 1 is not supported yet for a model that writes its reasoning apart ({fmt}): "
        "only the first completion's reasoning has a result column"
    )


def raw_lines(fmt: str | None, window: Any) -> set[int]:
    """The row indices of a planning window's /v1/completions lines when the job splits
    chat answers: they must not share an answer with a chat line of the same tokens."""
    if fmt is None or window.endpoints is None:
        return set()
    start = window.start
    return {start + i for i, url in enumerate(window.endpoints) if url == COMPLETIONS_URL}


def split_answers(
    llm: Any,
    fmt: str | None,
    outputs: Mapping[int, RequestOutput],
    endpoints: Mapping[int, str | None] | None = None,
) -> None:
    """Split each output's completions in place (`reasoning_content`, answer in `text`)
    with `llm`'s tokenizer when the job's rows are split (`fmt` is not None).

    `endpoints` (row index -> an OpenAI batch line's url): a /v1/completions line is
    sent raw, as OpenAI's completions endpoint does, so its text is left whole."""
    if fmt is None:
        return
    endpoints = endpoints or {}
    chat = [o for i, o in outputs.items() if o.outputs and endpoints.get(i) != COMPLETIONS_URL]
    split_reasoning_of(llm.tokenizer, chat)
