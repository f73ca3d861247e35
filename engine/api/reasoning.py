"""A chat answer's reasoning, split from its final text - for the models whose chat
templates make them write it apart (vLLM's `reasoning_content`):

- harmony (gpt-oss): the answer is messages on channels - `<|channel|>analysis
  <|message|>...<|end|>` is the reasoning, `final` the answer; any other channel
  (`commentary`: tool calls) stays in the answer;
- think tags (Qwen3, DeepSeek-R1): `<think>...</think>` before the answer.

`reasoning_format(tokenizer)` says which one a model's template produces (None: neither,
and nothing is split). Nothing is dropped: text outside any message goes to the answer,
and an answer cut short inside its reasoning is all reasoning, with an empty answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HARMONY, THINK_TAGS = "harmony", "think"
# The reasoning_effort values gpt-oss's template knows.
REASONING_EFFORTS = ("low", "medium", "high")
_HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class Split:
    """An answer as its reasoning (None: it wrote none) and its final text."""

    reasoning: str | None
    content: str


def reasoning_format(tokenizer: Any) -> str | None:
    """HARMONY, THINK_TAGS or None, from the model's chat template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|channel|>" in template:
        return HARMONY
    if "</think>" in template:
        return THINK_TAGS
    return None


def reasons_apart_with_effort(tokenizer: Any) -> bool:
    """Whether the chat template reads a `reasoning_effort` variable (gpt-oss's does)."""
    return "reasoning_effort" in (getattr(tokenizer, "chat_template", None) or "")


def split_reasoning_of(tokenizer: Any, outputs: list) -> None:
    """Split every completion of chat `outputs` (RequestOutputs) in place where the
    model's template reasons apart: `reasoning_content` and the answer in `text`."""
    fmt = reasoning_format(tokenizer)
    if fmt is None:
        return
    # harmony's markers are special tokens, read from the ids; the end-of-sequence tokens
    # that stopped a completion are not its text.
    eos = set(getattr(tokenizer, "eos_token_ids", ()))
    for output in outputs:
        for completion in output.outputs:
            ids = [t for t in completion.token_ids if t not in eos]
            with_specials = (
                tokenizer.decode(ids, skip_special_tokens=False)
                if fmt == HARMONY
                else completion.text
            )
            split = split_reasoning(fmt, completion.text, with_specials)
            completion.reasoning_content, completion.text = split.reasoning, split.content


def split_reasoning(fmt: str, text: str, text_with_specials: str) -> Split:
    """The answer of a model writing in `fmt`: `text` as decoded for the user, and
    `text_with_specials` with its special tokens kept (harmony's markers are special
    tokens)."""
    if fmt == HARMONY:
        return split_harmony(text_with_specials)
    if fmt == THINK_TAGS:
        return split_think_tags(text)
    raise ValueError(f"unknown reasoning format {fmt!r}")


def split_harmony(text: str) -> Split:
    """Harmony messages (`<|start|>role<|channel|>name<|message|>body<|end|>`, the first
    one's `<|start|>role` in the prompt): analysis bodies -> reasoning, the rest ->
    content, each in order."""
    reasoning: list[str] = []
    content: list[str] = []
    for segment in text.split("<|start|>"):
        header, found, body = segment.partition("<|message|>")
        if not found:  # no message in it: whatever text it holds is the answer's
            leftover = _without_markers(segment)
            if leftover:
                content.append(leftover)
            continue
        for end in _HARMONY_ENDS:
            body = body.split(end, 1)[0]
        channel = header.partition("<|channel|>")[2].split(" ")[0].split("<")[0].strip()
        (reasoning if channel == "analysis" else content).append(body)
    return Split("\n".join(reasoning) if reasoning else None, "".join(content))


def _without_markers(segment: str) -> str:
    """A segment without harmony's markers and role/channel words, if any text is left."""
    for marker in ("<|channel|>", "<|constrain|>", *_HARMONY_ENDS):
        segment = segment.replace(marker, " ")
    words = segment.split()
    if words and words[0] in ("assistant", "analysis", "final", "commentary"):
        words = words[1:]
    return " ".join(words)


def split_think_tags(text: str) -> Split:
    """`<think>reasoning</think>answer` (the opening tag may be in the prompt): the
    reasoning without its tags and edge whitespace, the answer without leading
    whitespace; an unclosed `<think>` is all reasoning."""
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        return Split(reasoning.replace("<think>", "", 1).strip(), content.lstrip())
    stripped = text.lstrip()
    if stripped.startswith("<think>"):
        return Split(stripped.removeprefix("<think>").strip(), "")
    return Split(None, text)
