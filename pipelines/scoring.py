"""Scoring jobs (`task="score"`): each row's prompt log-probability; nothing is generated.

A scoring row runs through the engine as a prompt-only request (`SamplingParams(
max_tokens=0, prompt_logprobs=0)`): its prompt is computed once, every token after the
first gets log p(token | the tokens before it) from that same forward pass, and no
token is sampled - so there is no completion to bill. Its result row has

    output              null (nothing is generated)
    finish_reason       "score" ("error" for an error row, as in generation)
    prompt_tokens       the prompt's tokens, all computed (see below)
    completion_tokens   0
    prompt_logprob_sum  the sum of log p over tokens 1..n-1: a prompt's first token has
                        no context, so no log-probability, and is not scored
    perplexity          exp(-prompt_logprob_sum / (n - 1))

What is scored. Text is scored as it is by default (`raw` unset means raw for a scoring
job): a perplexity filter over a corpus, or a ranking of candidate texts, wants the
text's own probability, not that of the text wrapped in a chat template. `raw=False`
(`--chat`) scores it as a user message through the chat template (after `system`, if
given), and a messages column is always rendered with it - in both cases without the
generation prompt (the assistant header a model answers after): nothing is generated,
so the conversation is scored as given. A prompt of one token has nothing to score and
becomes an error row before compute.

Cost. The engine computes prompt log-probabilities itself rather than serving them
from the prefix cache (`engine/sample/prompt_logprobs.py`), so every prompt token of a
scoring row is computed, and billed at the input price: `cached_tokens` is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmill.engine import POOLING_TASKS, SamplingParams

GENERATE, SCORE = "generate", "score"
# Every job task: generate, score, and the pooling tasks embed, classify, rerank
# (pipelines/pooling.py).
TASKS = (GENERATE, SCORE, *POOLING_TASKS)
SCORE_FINISH_REASON = "score"
# A score needs a token with a context: the second one.
MIN_SCORED_PROMPT_TOKENS = 2


def scoring_params() -> SamplingParams:
    """The engine parameters of every scoring row: score the prompt, sample nothing."""
    return SamplingParams(max_tokens=0, prompt_logprobs=0)


def default_raw(task: str) -> bool:
    """Whether prompt text is sent as it is when `raw` is not given (scored and pooled
    text is)."""
    return task != GENERATE


def min_prompt_tokens(task: str) -> int:
    """The fewest tokens a row's prompt may have."""
    return MIN_SCORED_PROMPT_TOKENS if task == SCORE else 1


def adds_generation_prompt(task: str) -> bool:
    """Whether chat-rendered prompts end with the assistant header a model answers after."""
    return task == GENERATE


def prompt_score(
    prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[dict[int, float] | None]
) -> tuple[float, float]:
    """(log-probability sum, perplexity) of a prompt from its engine entries.

    Args:
        prompt_token_ids: the prompt, n >= 2 tokens.
        prompt_logprobs: `RequestOutput.prompt_logprobs`: None for token 0, then one
            {token_id: logprob} per token holding at least that token.

    Returns:
        The sum over tokens 1..n-1, and exp(-sum / (n - 1)).

    Raises:
        ValueError: the entries do not cover the prompt.
    """
    if len(prompt_logprobs) != len(prompt_token_ids) or len(prompt_token_ids) < 2:
        raise ValueError(
            f"{len(prompt_logprobs)} prompt log-probability entries for a prompt of "
            f"{len(prompt_token_ids)} tokens"
        )
    total = math.fsum(
        entry[token] for entry, token in zip(prompt_logprobs[1:], prompt_token_ids[1:])
    )
    mean_nll = -total / (len(prompt_token_ids) - 1)
    return total, math.exp(mean_nll) if mean_nll < 709 else math.inf  # exp overflows past 709
