"""`describe_model`: what a job needs to know about a model before loading its weights.

Planning a job - templating every prompt, tokenizing it, checking it against the
context length, naming the model in the job id - needs the model's directory, its
context length, its chat template, its tokenizer and a hash of its weights, but not
the weights themselves. Resolving a model (a GGUF is converted once, then found in the
cache) and hashing its files (digests are cached by path, size and mtime) cost little
next to loading it, so a job with bad input fails before any weights are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.engine.loader.hub import snapshot_revision
from tokenmill.engine.loader.model_files import display_name, resolve_model, weights_hash
from tokenmill.engine.loader.tokenizer import Tokenizer, read_chat_template
from tokenmill.engine.models import load_config
from tokenmill.engine.pooling.config import served_tasks


@dataclass(frozen=True)
class ModelDescription:
    """A resolved model, described from its files (no weights loaded)."""

    name: str  # how ledgers and OpenAI batch output name it: the alias, or a base name
    model_dir: Path  # the HF-layout directory its weights load from
    max_context: int  # tokens, from config.json
    weights_hash: str  # sha256 over exactly the weight files that load
    chat_template: str | None  # jinja2 source; None: the model has none (prompts run raw)
    revision: str | None = None  # the Hub commit; None for local files and aliases
    # What it serves: generate, embed, classify, rerank (engine/pooling/config.py).
    tasks: tuple[str, ...] = ("generate",)

    @property
    def model_key(self) -> str:
        """What identifies the model in a job id: its weights, and its Hub commit (which
        also fixes its config and tokenizer files) where it has one."""
        return (
            self.weights_hash if self.revision is None else f"{self.weights_hash}@{self.revision}"
        )

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def load_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (tokenizer files only: milliseconds, not the weights)."""
        return Tokenizer.from_dir(self.model_dir)


def describe_model(
    model: str | os.PathLike | None = None,
    *,
    cache_root: str | os.PathLike | None = None,
    revision: str | None = None,
) -> ModelDescription:
    """Resolve `model` and describe it without loading its weights.

    Args:
        model: an HF-layout directory, a .gguf file, an alias, a Hub repo id, or None for
            the default model (as for `LLM(model)`).
        cache_root: where converted GGUF files live; default `model_files.cache_dir()`.
        revision: branch, tag or commit of a Hub repo id (default "main").

    Returns:
        The ModelDescription.

    Raises:
        ModelFilesError: the model cannot be found or its directory is incomplete.
    """
    model_dir = resolve_model(model, cache_root=cache_root, revision=revision)
    commit = snapshot_revision(model_dir)
    return ModelDescription(
        name=name_with_revision(display_name(model), commit),
        model_dir=model_dir,
        max_context=load_config(model_dir).max_context,
        weights_hash=weights_hash(model_dir),
        chat_template=read_chat_template(model_dir),
        revision=commit,
        tasks=served_tasks(model_dir),
    )


def name_with_revision(name: str, revision: str | None) -> str:
    """How a ledger names a Hub model: "org/name@<commit>"; other names as they are."""
    return name if revision is None else f"{name}@{revision}"
