"""Rendered prompts -> token ids, through the tokenizer's one batch path.

Chat-rendered text already carries the template's special tokens, so it is encoded
without adding more; raw text gets the tokenizer's usual specials (e.g. BOS). The
special-token strings a row's data brought into its text (`RenderedRow.data_spans`) are
encoded as plain text. A prompt that cannot fit the context together with its completion
budget becomes an error row here, before it reaches the engine - or, where the caller
caps budgets (an OpenAI batch line's max_tokens), is given the context left instead.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from tokenmill.pipelines.reasoning import check_reasoning_effort
from tokenmill.pipelines.templating import ChatRenderer, RenderedRow, SpecialStrings


class BatchTokenizer(Protocol):
    """Encodes texts; `data_spans` (given only when a text has some) are encoded as text."""

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True, **data_spans: Any
    ) -> list[list[int]]: ...


@dataclass
class PromptRow:
    """One input row on its way to the engine.

    `params_index` points into the job's list of distinct SamplingParams so rows that
    share settings (the usual case) share one object; `lora_index` into the job's LoRA
    adapters (0: the base model; `pipelines/adapters.py`).
    """

    row_index: int
    id: str
    # A compact int32 array (4 bytes a token, not a Python int object each): a planning
    # window holds tens of thousands of rows, so this is most of its memory.
    token_ids: Sequence[int] | None = None
    error: str | None = None
    params_index: int = 0
    lora_index: int = 0
    # Pooling rows: the text was cut to the model's max_seq_length (pipelines/pooling.py).
    truncated: bool = False
    # The completion budget the row asked for, when it was capped to the context left
    # (`tokenize_rows`' cap_budget); its params then hold the capped budget.
    max_tokens_requested: int | None = None
    # The row's images, encoded, in the order its prompt places them (`pipelines/images.py`),
    # and each one's content hash; empty for a text row.
    images: tuple[bytes, ...] = ()
    image_hashes: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.error is None):
            raise ValueError(f"row {self.id}: exactly one of token_ids and error must be set")

    @property
    def num_prompt_tokens(self) -> int:
        return 0 if self.token_ids is None else len(self.token_ids)


def overlong_error(num_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt of `num_tokens` cannot be served, or None when it fits."""
    if num_tokens > max_model_len:
        return (
            f"prompt is {num_tokens} tokens, longer than the model's context of "
            f"{max_model_len} tokens"
        )
    if num_tokens + max_tokens > max_model_len:
        return (
            f"prompt is {num_tokens} tokens; with max_tokens={max_tokens} it exceeds the "
            f"model's context of {max_model_len} tokens (lower max_tokens or shorten the prompt)"
        )
    return None


def short_error(num_tokens: int, min_prompt_tokens: int) -> str | None:
    """Why a prompt of `num_tokens` is too short, or None."""
    if num_tokens == 0:
        return "prompt encodes to no tokens"
    if num_tokens < min_prompt_tokens:
        return (
            f"prompt encodes to {num_tokens} token(s), and scoring needs {min_prompt_tokens}: "
            "a prompt's first token has no log-probability"
        )
    return None


def tokenize_rows(
    tokenizer: BatchTokenizer,
    rendered: Sequence[RenderedRow],
    *,
    max_model_len: int,
    max_tokens: Sequence[int] | int,
    params_index: Sequence[int] | int = 0,
    min_prompt_tokens: int = 1,
    lora_index: Sequence[int] | int = 0,
    cap_budget: Callable[[int, int], int] | None = None,
) -> list[PromptRow]:
    """Batch-encode rendered rows and turn over-long (or too short) prompts into error rows.

    Args:
        tokenizer: anything with `encode_batch(texts, add_special_tokens=...)`.
        rendered: rows from `render_rows`; error rows pass through unchanged.
        max_model_len: the model's context length in tokens.
        max_tokens: completion budget, one for all rows or one per row.
        params_index: index of each row's SamplingParams (one for all, or per row).
        min_prompt_tokens: the fewest tokens a prompt may have (2 to score one:
            `scoring.min_prompt_tokens`).
        lora_index: each row's LoRA adapter (one for all, or per row).
        cap_budget: caps budgets instead of refusing them: a prompt that fits the context
            but not with its budget runs with the context left, under the params index
            `cap_budget(params_index, tokens_left)` returns (an error row if that raises
            ValueError); the row keeps the budget it asked for in `max_tokens_requested`.

    Returns:
        One PromptRow per rendered row, same order.
    """
    n = len(rendered)
    budgets = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    params = [params_index] * n if isinstance(params_index, int) else list(params_index)
    loras = [lora_index] * n if isinstance(lora_index, int) else list(lora_index)
    encoded: dict[int, list[int]] = {}
    for is_chat in (False, True):
        positions = [i for i, r in enumerate(rendered) if r.error is None and r.is_chat == is_chat]
        if not positions:
            continue
        texts = [rendered[i].text for i in positions]
        spans = [rendered[i].data_spans for i in positions]
        # Only a batch with data's special strings asks for them: most never do.
        extra = {"data_spans": spans} if any(spans) else {}
        ids = tokenizer.encode_batch(texts, add_special_tokens=not is_chat, **extra)
        encoded.update(zip(positions, ids))
    rows = []
    for i, r in enumerate(rendered):
        indices = {"params_index": params[i], "lora_index": loras[i]}
        if r.error is not None:
            rows.append(PromptRow(r.row_index, r.id, error=r.error, **indices))
            continue
        token_ids = array("i", encoded[i])
        problem = short_error(len(token_ids), min_prompt_tokens)
        problem = problem or overlong_error(len(token_ids), budgets[i], max_model_len)
        if problem is not None and cap_budget is not None and len(token_ids) < max_model_len:
            try:
                indices["params_index"] = cap_budget(params[i], max_model_len - len(token_ids))
            except ValueError as exc:  # e.g. a min_tokens above the context left
                problem = f"{problem}; capped to the context left: {exc}"
            else:
                row = PromptRow(r.row_index, r.id, token_ids=token_ids, **indices)
                row.max_tokens_requested = budgets[i]
                rows.append(row)
                continue
        if problem is not None:
            rows.append(PromptRow(r.row_index, r.id, error=problem, **indices))
        else:
            rows.append(PromptRow(r.row_index, r.id, token_ids=token_ids, **indices))
    return rows


def chat_renderer(tokenizer: Any, *, add_generation_prompt: bool = True) -> ChatRenderer | None:
    """The tokenizer's chat template as a messages -> text function (None if it has none).

    Template errors (e.g. a template's own `raise_exception` for a role order it does
    not accept) are turned into ValueError so they become per-row errors.

    Args:
        tokenizer: the model's tokenizer.
        add_generation_prompt: end with the assistant header a model answers after (off
            for scoring, which scores a conversation as given).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    render = partial(
        tokenizer.apply_chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
    )

    def _render(messages: list[dict[str, Any]], **variables: Any) -> str:
        if "reasoning_effort" in variables:
            check_reasoning_effort(tokenizer, variables["reasoning_effort"])
        try:
            return render(messages, **variables)
        except ValueError:
            raise
        except Exception as exc:  # jinja2 errors and the like: this row only
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    return _render


def special_strings(tokenizer: Any) -> SpecialStrings | None:
    """The tokenizer's special-token strings, which `render_rows` keeps as data where rows
    hold them (None: a tokenizer without any)."""
    return getattr(tokenizer, "special_text", None)
