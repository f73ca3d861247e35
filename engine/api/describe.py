"""`describe_model`: what a job needs to know about a model before loading its weights.

Planning a job - templating every prompt, tokenizing it, checking it against the
context length, naming the model in the job id - needs the model's directory, its
context length, its chat template, its tokenizer and a hash of its weights, but not
the weights themselves. Resolving a model (a GGUF is converted once, then found in the
cache) and hashing its files (digests are cached by path, size and mtime) cost little
next to loading it, so a job with bad input fails before any weights are read. The
description also answers, from the files, what planning asks next: whether the model is
an encoder, and whether a structured outputs constraint compiles for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from tokenmill.engine.core.grammar import GrammarCompiler
from tokenmill.engine.loader.hub import snapshot_revision
from tokenmill.engine.loader.model_files import display_name, resolve_model, weights_hash
from tokenmill.engine.loader.tokenizer import Tokenizer, read_chat_template
from tokenmill.engine.models import ModelConfig, architecture_for, load_config
from tokenmill.engine.pooling.config import served_tasks
from tokenmill.engine.quant.checkpoint_formats import check_checkpoint_quantization
from tokenmill.engine.types.structured_outputs import StructuredOutputs


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
    # A checkpoint quantized by another tool, its format and scheme as a user reads them
    # ("compressed-tensors pack-quantized, W4A16 g64"); None for float weights.
    quantization: str | None = None

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

    def named(self, name: str) -> ModelDescription:
        """This description under another display name (a Hub model's commit appended,
        as describe_model names it)."""
        return replace(self, name=name_with_revision(name, self.revision))

    @cached_property
    def config(self) -> ModelConfig:
        """Its architecture's config, from config.json."""
        return load_config(self.model_dir)

    @property
    def is_encoder(self) -> bool:
        """Whether it is an encoder (BERT family: pooling only, no KV cache)."""
        return architecture_for(self.config).is_encoder

    def constraint_check(self, tokenizer: Tokenizer) -> Callable[[StructuredOutputs], None]:
        """A function that compiles a structured outputs constraint for this model as the
        engine would (ValueError naming what is invalid), the compiler built on first use."""
        compilers: list[GrammarCompiler] = []

        def check(constraint: StructuredOutputs) -> None:
            if not compilers:
                config = self.config
                compilers.append(
                    GrammarCompiler.for_model(tokenizer, config.vocab_size, config.eos_token_ids)
                )
            compilers[0].compile(constraint)

        return check


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
        ValueError: its checkpoint is quantized in a format the engine does not read -
            said here, so a job's plan and its dry run refuse it as loading would.
    """
    model_dir = resolve_model(model, cache_root=cache_root, revision=revision)
    checkpoint = check_checkpoint_quantization(model_dir)
    commit = snapshot_revision(model_dir)
    return ModelDescription(
        name=name_with_revision(display_name(model), commit),
        model_dir=model_dir,
        max_context=load_config(model_dir).max_context,
        weights_hash=weights_hash(model_dir),
        chat_template=read_chat_template(model_dir),
        revision=commit,
        tasks=served_tasks(model_dir),
        quantization=None if checkpoint is None else checkpoint.summary,
    )


def name_with_revision(name: str, revision: str | None) -> str:
    """How a ledger names a Hub model: "org/name@<commit>"; other names as they are."""
    return name if revision is None else f"{name}@{revision}"
