"""The project's one tokenizer: a `tokenizers.Tokenizer` plus the model's special tokens and
chat template, rendered in a sandbox because templates come from untrusted model files."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from tokenizers import Tokenizer as _BackendTokenizer

from tokenmill.engine.loader.chat_sandbox import add_filter, make_environment, render_limited
from tokenmill.engine.loader.special_text import Spans, SpecialText

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode/decode and chat templating for one model directory."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        chat_template: str | None = None,
        generation_eos_ids: list[int] | None = None,
        generation_pad_id: int | None = None,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`.

        Args:
            backend: the Rust tokenizer (its padding and truncation are switched off).
            special_tokens: `bos_token`/`eos_token`/`unk_token`/`pad_token` strings, as in
                tokenizer_config.json.
            chat_template: jinja2 source of the chat template, if the model has one.
            generation_eos_ids: extra end-of-sequence ids from generation_config.json.
            generation_pad_id: pad id from generation_config.json, used if there is no pad token.
        """
        self._backend = backend
        # Encoding must give exactly the tokens of the text; padding is the engine's business.
        backend.no_padding()
        backend.no_truncation()
        self.special_tokens = {k: (special_tokens or {}).get(k) for k in _SPECIAL_TOKEN_KEYS}
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id(self.special_tokens["bos_token"])
        self.pad_token_id = self._token_id(self.special_tokens["pad_token"])
        if self.pad_token_id is None:
            self.pad_token_id = generation_pad_id
        eos_ids = [self._token_id(self.special_tokens["eos_token"]), *(generation_eos_ids or [])]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos_ids if i is not None))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from an HF-layout directory.

        Args:
            path: directory with tokenizer.json, tokenizer_config.json and optionally
                generation_config.json and chat_template.jinja.

        Returns:
            The tokenizer.
        """
        path = Path(path)
        backend = _BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        special_tokens = {k: _token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        eos = generation.get("eos_token_id")
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_template=read_chat_template(path),
            generation_eos_ids=eos if isinstance(eos, list) else [eos] if eos is not None else [],
            generation_pad_id=generation.get("pad_token_id"),
        )

    @property
    def backend(self) -> _BackendTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def encode(
        self, text: str, add_special_tokens: bool = True, *, data_spans: Spans = ()
    ) -> list[int]:
        """Token ids of `text` (with BOS/EOS only if the tokenizer adds them).

        Args:
            text: the text.
            add_special_tokens: add the tokenizer's BOS/EOS.
            data_spans: spans of special-token strings that are data, encoded as plain
                text (`special_text.find(text)` for text that is data throughout);
                every other special string becomes its control token.
        """
        if data_spans:
            return self.special_text.encode_batch([text], [data_spans], add_special_tokens)[0]
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self,
        texts: list[str],
        add_special_tokens: bool = True,
        *,
        data_spans: Sequence[Spans] | None = None,
    ) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust batch encoder.

        Args:
            texts: the texts.
            add_special_tokens: add the tokenizer's BOS/EOS around each.
            data_spans: per text, the spans of its special-token strings that are data
                (as for `encode`); None or () where there are none.
        """
        texts = list(texts)
        if data_spans is not None and len(data_spans) != len(texts):
            raise ValueError(f"{len(data_spans)} data_spans for {len(texts)} texts")
        marked = [i for i, spans in enumerate(data_spans or ()) if spans]
        # encode_batch_fast (tokenizers >= 0.20) skips computing offsets we never use.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        if not marked:
            return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
        # Only texts holding data's special strings take the slower way.
        taken = set(marked)
        plain = [i for i in range(len(texts)) if i not in taken]
        ids: list[list[int] | None] = [None] * len(texts)
        if plain:
            encoded = encode([texts[i] for i in plain], add_special_tokens=add_special_tokens)
            for i, encoding in zip(plain, encoded):
                ids[i] = encoding.ids
        spanned = self.special_text.encode_batch(
            [texts[i] for i in marked], [data_spans[i] for i in marked], add_special_tokens
        )
        for i, row in zip(marked, spanned):
            ids[i] = row
        return ids

    @cached_property
    def special_text(self) -> SpecialText:
        """The special-token strings, found in data and encoded there as plain text."""
        return SpecialText(self._backend)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Text of many id lists."""
        return self._backend.decode_batch([list(ids) for ids in batch], skip_special_tokens)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes: a byte-level token may hold part of a UTF-8 character,
        which its decoded text cannot show (it comes out as U+FFFD)."""
        lltokenizer = self._lltokenizer
        if lltokenizer is None:
            return [self.decode([i], skip_special_tokens=False).encode() for i in ids]
        return [lltokenizer.decode_bytes([i]) for i in ids]

    @cached_property
    def _lltokenizer(self) -> Any:
        """llguidance's view of the vocabulary, which knows each token's bytes (None for a
        tokenizer it cannot read)."""
        import llguidance

        try:
            return llguidance.LLTokenizer(self._backend.to_str())
        except Exception:  # llguidance raises plain exceptions for formats it does not know
            return None

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        image_parts: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template, in a jinja2 sandbox.

        Args:
            messages: `[{"role": ..., "content": ...}, ...]` with string roles and contents.
            add_generation_prompt: end with the header that starts the assistant's turn.
            tokenize: return token ids instead of text (the template supplies any BOS itself);
                special-token strings in the messages and variables are encoded as plain
                text (`render_chat`).
            image_parts: let a message's content be a list of `{"type": "text", "text":
                ...}` and `{"type": "image"}` parts, as multimodal templates take them -
                only for a caller that places each image where the template marks it
                (`LLM.chat`), never where an image could be dropped.
            **extra: more template variables (e.g. `tools`, `date_string`).

        Returns:
            The prompt text, or its token ids if `tokenize`.
        """
        if tokenize:
            text, spans = self.render_chat(
                messages, add_generation_prompt=add_generation_prompt, **extra
            )
            return self.encode(text, add_special_tokens=False, data_spans=spans)
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass plain prompts instead")
        _check_messages(messages, image_parts)
        variables = {**self.special_tokens, **extra}
        return render_limited(
            self._compiled_template,
            {"messages": messages, "add_generation_prompt": add_generation_prompt, **variables},
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        allow_special_tokens: bool = False,
        image_parts: bool = False,
        **extra: Any,
    ) -> tuple[str, Spans]:
        """The chat template's text for a conversation, and where in it the messages'
        special-token strings are: they are data, to encode as plain text
        (`encode(text, data_spans=spans)`); the template's own markup is not.

        Args:
            messages: as for `apply_chat_template`.
            add_generation_prompt: end with the header that starts the assistant's turn.
            allow_special_tokens: leave special strings in the messages to become control
                tokens (no spans).
            image_parts: as for `apply_chat_template`.
            **extra: more template variables; their strings are data too.
        """
        if allow_special_tokens:
            text = self.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                image_parts=image_parts,
                **extra,
            )
            return text, ()
        marks = self.special_text.marks()
        text = self.apply_chat_template(
            marks.mark(messages),
            add_generation_prompt=add_generation_prompt,
            image_parts=image_parts,
            **marks.mark(extra),
        )
        return marks.restore(text)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in an immutable sandbox, with the helpers HF templates expect.

    Args:
        source: the jinja2 template text.

    Returns:
        The compiled template; rendering it cannot reach Python internals (SecurityError),
        and `render_limited` bounds its time and size (`engine/loader/chat_sandbox.py`).
    """
    # trim_blocks/lstrip_blocks and loopcontrols match transformers, so prompts are identical.
    env = make_environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    add_filter(env, "tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class _Namespace(jinja2.utils.Namespace):
    """A jinja2 namespace that refuses underscore names, so templates cannot plant dunders."""

    def __setitem__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set attribute {name!r}")
        super().__setitem__(name, value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    # jinja's own tojson HTML-escapes; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _check_messages(messages: Any, image_parts: bool = False) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} needs a string 'role', got {message.get('role')!r}")
        content = message.get("content")
        if image_parts and isinstance(content, list) and all(map(_is_template_part, content)):
            continue  # text and image parts, as multimodal chat templates take them
        if not isinstance(content, str):
            raise ValueError(f"message {i} needs a string 'content', got {content!r}")


def _is_template_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    if part.get("type") == "image":
        return set(part) == {"type"}
    return part.get("type") == "text" and isinstance(part.get("text"), str) and len(part) == 2


def read_chat_template(path: str | os.PathLike) -> str | None:
    """The chat template of an HF-layout directory, or None when the model has none.

    Read without loading the tokenizer, so a job can decide how to send its prompts
    before anything is loaded.
    """
    path = Path(path)
    # transformers >= 4.43 may save the template beside the config instead of inside it.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
