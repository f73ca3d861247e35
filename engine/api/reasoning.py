"""A chat answer's reasoning, split from its final text - for the models whose chat
templates make them write it apart (vLLM's `reasoning_content`):

- harmony (gpt-oss): the answer is messages on channels - `<|channel|>analysis
  <|message|>...<|end|>` is the reasoning, `final` the answer; any other channel
  (`commentary`: tool calls) stays in the answer;
- think tags (Qwen3, DeepSeek-R1): `<think>...</think>` before the answer.

`reasoning_format(tokenizer)` says which one a model's template produces (None: neither,
and nothing is split). Nothing is dropped: text outside any message goes to the answer,
and an answer cut short inside its reasoning is all reasoning, with an empty answer.

Each split is found as character spans of the text (`reasoning_spans`), so the same
spans count the completion's reasoning tokens (`reasoning_tokens`, OpenAI's usage
field): a token is a reasoning token when its text begins inside a span - the markers
(`<think>`, harmony's headers and `<|end|>`) are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.engine.core.detokenizer import IncrementalDetokenizer

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
    model's template reasons apart: `reasoning_content`, the answer in `text`, and
    `reasoning_tokens`."""
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
            completion.reasoning_tokens = reasoning_tokens(tokenizer, fmt, ids)


def reasoning_tokens(tokenizer: Any, fmt: str, ids: list[int]) -> int:
    """How many of a completion's token ids (end-of-sequence ids left out) begin inside
    the reasoning the split of their text takes out; the text decoded token by token,
    harmony's with its special tokens (its markers)."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=fmt != HARMONY)
    starts = []
    for token_id in ids:
        # A token that only begins a multi-byte character emits nothing yet: it starts
        # where the character will, as the token that completes it does.
        starts.append(len(detokenizer.text))
        detokenizer.add(token_id)
    detokenizer.finish()
    spans = reasoning_spans(fmt, detokenizer.text)
    return sum(any(a <= start < b for a, b in spans) for start in starts)


def reasoning_spans(fmt: str, text: str) -> list[tuple[int, int]]:
    """The [start, end) character spans of `text` its split puts in reasoning, in order."""
    if fmt == HARMONY:
        return [(a, b) for channel, a, b in _harmony_pieces(text) if channel == "analysis"]
    if fmt == THINK_TAGS:
        return _think_spans(text)
    raise ValueError(f"unknown reasoning format {fmt!r}")


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
    for channel, start, end in _harmony_pieces(text):
        if channel is None:  # no message in it: whatever text it holds is the answer's
            leftover = _without_markers(text[start:end])
            if leftover:
                content.append(leftover)
            continue
        (reasoning if channel == "analysis" else content).append(text[start:end])
    return Split("\n".join(reasoning) if reasoning else None, "".join(content))


def _harmony_pieces(text: str) -> list[tuple[str | None, int, int]]:
    """(channel, start, end) of each message body in `text`, up to its end marker; a
    segment between `<|start|>`s that holds no message is a piece with channel None."""
    pieces: list[tuple[str | None, int, int]] = []
    offset = 0
    for segment in text.split("<|start|>"):
        header, found, body = segment.partition("<|message|>")
        if not found:
            pieces.append((None, offset, offset + len(segment)))
        else:
            for end in _HARMONY_ENDS:
                body = body.split(end, 1)[0]
            channel = header.partition("<|channel|>")[2].split(" ")[0].split("<")[0].strip()
            body_start = offset + len(header) + len("<|message|>")
            pieces.append((channel, body_start, body_start + len(body)))
        offset += len(segment) + len("<|start|>")
    return pieces


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
    spans = _think_spans(text)
    if not spans:
        return Split(None, text)
    reasoning = "".join(text[a:b] for a, b in spans).strip()
    closing = text.find("</think>")
    return Split(reasoning, "" if closing < 0 else text[closing + len("</think>") :].lstrip())


def _think_spans(text: str) -> list[tuple[int, int]]:
    """The reasoning before `</think>` less its first `<think>` tag, or after a leading
    unclosed `<think>`; [] when the text has neither."""
    closing = text.find("</think>")
    if closing < 0:
        opening = len(text) - len(text.lstrip())
        if not text.startswith("<think>", opening):
            return []
        return [(opening + len("<think>"), len(text))]
    opening = text.find("<think>", 0, closing)
    if opening < 0:
        return [(0, closing)]
    return [(0, opening), (opening + len("<think>"), closing)]
