"""Incremental detokenization: the text of a sequence as its tokens arrive, for stop strings."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """What detokenizing needs of a tokenizer (`loader.tokenizer.Tokenizer` is one)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of a growing list of generated tokens, decoding only a short window per step.

    The window starts at the tokens emitted last, so decoders that treat the first token
    specially (sentencepiece's leading space) see the same context every time.
    While the window's text ends in U+FFFD a multi-byte character is still incomplete, and
    nothing is emitted until a later token completes it (or `finish` is called).
    """

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # the tokens emitted last, then the pending ones
        self._num_emitted_in_window = 0  # leading tokens of the window whose text is out
        self.text = ""  # everything emitted so far

    def add(self, token_ids: int | list[int]) -> str:
        """Append newly generated token(s).

        Args:
            token_ids: one id or a list of ids.

        Returns:
            The new text they complete ("" while a character is still incomplete).
        """
        self._window.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        emitted = self._decode(self._window[: self._num_emitted_in_window])
        current = self._decode(self._window)
        if len(current) <= len(emitted) or current.endswith("\ufffd"):
            return ""
        return self._emit(current[len(emitted) :])

    def finish(self) -> str:
        """Emit whatever is still pending, incomplete characters included (as U+FFFD)."""
        emitted = self._decode(self._window[: self._num_emitted_in_window])
        current = self._decode(self._window)
        return self._emit(current[len(emitted) :]) if len(current) > len(emitted) else ""

    def _emit(self, delta: str) -> str:
        # The tokens just emitted become the next window's context: they start right after a
        # complete character, so decoding from them never begins mid-character.
        self._window = self._window[self._num_emitted_in_window :]
        self._num_emitted_in_window = len(self._window)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return (
            self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
            if ids
            else ""
        )
