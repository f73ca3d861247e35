"""Reasoning split from chat answers (api/reasoning.py): gpt-oss's harmony channels and
Qwen3's <think> tags, on exact strings and through LLM.chat with a real engine whose
output a choice constraint fixes; reasoning_effort into the chat template."""

from __future__ import annotations

import pytest
from tiny_model import build_tiny_model

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.api.reasoning import (
    HARMONY,
    THINK_TAGS,
    Split,
    reasoning_format,
    split_harmony,
    split_reasoning_of,
    split_think_tags,
)
from tokenmill.engine.types.outputs import CompletionOutput
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.structured_outputs import StructuredOutputs

# gpt-oss's answer after its prompt's `<|start|>assistant`.
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>4<|return|>"
)


def test_harmony_analysis_is_reasoning_and_final_is_the_answer():
    assert split_harmony(HARMONY_ANSWER) == Split("User asks 2+2. Simple.", "4")


def test_harmony_cut_inside_its_analysis_is_all_reasoning():
    assert split_harmony("<|channel|>analysis<|message|>Let me th") == Split("Let me th", "")


def test_harmony_keeps_other_channels_and_stray_text_in_the_answer():
    answer = (
        "<|channel|>analysis<|message|>need a tool<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.f <|constrain|>json<|message|>{"x": 1}<|call|>'
    )
    assert split_harmony(answer) == Split("need a tool", '{"x": 1}')
    assert split_harmony("plain words") == Split(None, "plain words")


def test_think_tags():
    assert split_think_tags("<think>\nhmm\n</think>\n\nYes.") == Split("hmm", "Yes.")
    # The opening tag in the prompt (DeepSeek-R1's template): only the closing one here.
    assert split_think_tags("hmm</think>Yes.") == Split("hmm", "Yes.")
    assert split_think_tags("<think>cut sho") == Split("cut sho", "")
    assert split_think_tags("No tags.") == Split(None, "No tags.")


def make_model(path, template: str) -> None:
    """The tiny random Llama (a byte-level BPE tokenizer) with this chat template."""
    build_tiny_model(path, chat_template=template)


THINK_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# <think></think> #}"
HARMONY_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{{ reasoning_effort | default('medium') }}{# <|channel|> #}"
)


def chat_once(path, choice: str, **chat_args):
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(
        temperature=0,
        max_tokens=len(choice) + 2,
        structured_outputs=StructuredOutputs(choice=[choice]),
    )
    return llm, llm.chat([{"role": "user", "content": "hi"}], params, **chat_args)[0]


def test_chat_splits_think_tags(tmp_path):
    make_model(tmp_path, THINK_TEMPLATE)
    llm, out = chat_once(tmp_path, "<think>two plus two</think>four")
    assert reasoning_format(llm.tokenizer) == THINK_TAGS
    assert out.outputs[0].reasoning_content == "two plus two"
    assert out.outputs[0].text == out.text == "four"
    # Plain generate is not a chat answer: nothing is split.
    raw = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    assert raw.reasoning_content is None


def test_chat_splits_harmony_and_takes_reasoning_effort(tmp_path):
    make_model(tmp_path, HARMONY_TEMPLATE)
    answer = (
        "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>four"
    )
    llm, out = chat_once(tmp_path, answer, reasoning_effort="high")
    assert reasoning_format(llm.tokenizer) == HARMONY
    assert out.prompt == "hihigh"
    assert (out.outputs[0].reasoning_content, out.text) == ("easy", "four")
    with pytest.raises(ValueError, match="reasoning_effort must be one of low, medium, high"):
        llm.chat([{"role": "user", "content": "hi"}], reasoning_effort="max")


def test_a_template_without_reasoning_splits_nothing_and_refuses_reasoning_effort(tmp_path):
    make_model(tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    llm, out = chat_once(tmp_path, "<think>kept</think>as is")
    assert reasoning_format(llm.tokenizer) is None
    assert (out.outputs[0].reasoning_content, out.text) == (None, "<think>kept</think>as is")
    with pytest.raises(ValueError, match="chat template does not read it"):
        llm.chat([{"role": "user", "content": "hi"}], reasoning_effort="low")


def smollm2_with(markers: list[str], *, special: bool, chat_template: str):
    """SmolLM2's real tokenizer (the embedded default model's) with the markers added
    as single tokens - special, as gpt-oss's are, or not, as Qwen3's <think> is."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from tokenmill.engine import DEFAULT_MODEL, resolve_model
    from tokenmill.engine.loader.tokenizer import Tokenizer

    backend = Backend.from_file(str(resolve_model(DEFAULT_MODEL) / "tokenizer.json"))
    added = [AddedToken(m, special=special, normalized=False) for m in markers]
    (backend.add_special_tokens if special else backend.add_tokens)(added)
    return Tokenizer(
        backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=chat_template
    )


class Answer:
    """A completion of `text`'s tokens as the engine hands it back (the eos id last)."""

    def __init__(self, tokenizer, text: str) -> None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        self.outputs = [CompletionOutput(0, text, [*ids, *tokenizer.eos_token_ids], "stop")]
        self.ids = ids


def _between(ids: list[int], opening: int | None, closing: int) -> int:
    """Tokens after `opening`'s id (None: from the start) up to `closing`'s."""
    start = 0 if opening is None else ids.index(opening) + 1
    return ids.index(closing, start) - start


def test_reasoning_tokens_are_the_tokens_between_harmony_markers():
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
    tokenizer = smollm2_with(markers, special=True, chat_template=HARMONY_TEMPLATE)
    # multi-byte characters split across byte-level tokens inside the reasoning
    text = (
        "<|channel|>analysis<|message|>User asks 2+2 — 日本語 ünïcödé. Simple.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4 is it.<|return|>"
    )
    answer = Answer(tokenizer, text)
    message, end = (tokenizer.backend.token_to_id(m) for m in ("<|message|>", "<|end|>"))
    want = _between(answer.ids, message, end)
    assert want >= 10
    split_reasoning_of(tokenizer, [answer])
    completion = answer.outputs[0]
    assert completion.reasoning_content == "User asks 2+2 — 日本語 ünïcödé. Simple."
    assert completion.text == "4 is it."
    assert completion.reasoning_tokens == want


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>\nLet me think: 7×6 = 42.\n</think>\n\nIt is 42.", "Let me think: 7×6 = 42.", "It is 42."),
        ("opening tag in the prompt</think>Yes.", "opening tag in the prompt", "Yes."),
        ("<think>cut short in the middle", "cut short in the middle", ""),
        ("No reasoning at all.", None, "No reasoning at all."),
    ],
)  # fmt: skip
def test_reasoning_tokens_are_the_tokens_inside_think_tags(text, reasoning, content):
    tokenizer = smollm2_with(["<think>", "</think>"], special=False, chat_template=THINK_TEMPLATE)
    answer = Answer(tokenizer, text)
    opening, closing = (tokenizer.backend.token_to_id(m) for m in ("<think>", "</think>"))
    ids = answer.ids
    if closing in ids:
        want = _between(ids, opening if opening in ids else None, closing)
    else:
        want = len(ids) - ids.index(opening) - 1 if opening in ids else 0
    split_reasoning_of(tokenizer, [answer])
    completion = answer.outputs[0]
    assert (completion.reasoning_content, completion.text) == (reasoning, content)
    assert completion.reasoning_tokens == want


def test_reasoning_tokens_where_the_markers_are_text_of_several_tokens(tmp_path):
    """The tiny model's markers are plain BPE text: a token counts when its text begins
    inside the reasoning, as the text decoded up to it (each prefix whole) says."""
    make_model(tmp_path, THINK_TEMPLATE)
    llm, out = chat_once(tmp_path, "<think>two plus two</think>four")
    completion = out.outputs[0]
    ids = [t for t in completion.token_ids if t not in llm.tokenizer.eos_token_ids]
    full = llm.tokenizer.decode(ids)
    assert full == "<think>two plus two</think>four"
    starts = [len(llm.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    inside = [s for s in starts if len("<think>") <= s < full.index("</think>")]
    assert 0 < len(inside) < len(ids)
    assert completion.reasoning_tokens == len(inside)
