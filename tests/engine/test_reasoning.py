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
    split_think_tags,
)
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
