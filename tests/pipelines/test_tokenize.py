from __future__ import annotations

import pytest

from tokenmill.pipelines.templating import RenderedRow
from tokenmill.pipelines.tokenize import PromptRow, overlong_error, tokenize_rows


def test_raw_gets_specials_chat_does_not(tokenizer):
    rendered = [RenderedRow(0, "a", text="ab"), RenderedRow(1, "b", text="<x>", is_chat=True)]
    rows = tokenize_rows(tokenizer, rendered, max_model_len=100, max_tokens=10)
    assert list(rows[0].token_ids) == [1, 97, 98]
    assert list(rows[1].token_ids) == [60, 120, 62]


def test_overlong_prompts_become_error_rows(tokenizer):
    rendered = [
        RenderedRow(0, "fits", text="x" * 5),  # 6 tokens + 4 = 10
        RenderedRow(1, "budget", text="x" * 6),  # 7 tokens + 4 > 10
        RenderedRow(2, "context", text="x" * 20),  # 21 > 10
        RenderedRow(3, "bad", error="prompt is null"),
    ]
    rows = tokenize_rows(tokenizer, rendered, max_model_len=10, max_tokens=4)
    assert rows[0].token_ids is not None and rows[0].error is None
    assert rows[1].error == (
        "prompt is 7 tokens; with max_tokens=4 it exceeds the model's context of 10 tokens "
        "(lower max_tokens or shorten the prompt)"
    )
    assert rows[2].error == "prompt is 21 tokens, longer than the model's context of 10 tokens"
    assert rows[3].error == "prompt is null" and rows[3].token_ids is None


def test_per_row_budgets_and_params(tokenizer):
    rendered = [RenderedRow(0, "a", text="xx"), RenderedRow(1, "b", text="xx")]
    rows = tokenize_rows(
        tokenizer, rendered, max_model_len=10, max_tokens=[7, 8], params_index=[0, 1]
    )
    assert rows[0].error is None and rows[0].params_index == 0
    assert rows[1].error is not None and rows[1].params_index == 1


def test_one_encode_call_per_kind():
    calls = []

    class Counting:
        def encode_batch(self, texts, add_special_tokens=True):
            calls.append((len(texts), add_special_tokens))
            return [[1]] * len(texts)

    rendered = [RenderedRow(i, str(i), text="t", is_chat=i % 2 == 0) for i in range(5)]
    tokenize_rows(Counting(), rendered, max_model_len=10, max_tokens=1)
    assert calls == [(2, True), (3, False)]


def test_overlong_error_none_when_fits():
    assert overlong_error(6, 4, 10) is None


def test_prompt_row_needs_tokens_or_error():
    with pytest.raises(ValueError, match="exactly one"):
        PromptRow(0, "x")
