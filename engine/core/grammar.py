"""Grammar-constrained decoding with llguidance: compile constraints, track each
sequence's grammar state, fill a step's allowed-token bitmask.

Why llguidance: it compiles a schema 10-100x faster than xgrammar, rejects the schema
keywords it cannot enforce where xgrammar drops them silently, and its wheel has no
dependencies; xgrammar's faster mask fill is well under 1% of a decode step
(docs/design.md, "Why llguidance"). It is imported where it is used: only a job
with a constrained request pays for it.

Invariants:
- One `LLTokenizer` per tokenizer and one compiled matcher per distinct constraint, per
  process (bounded LRU caches, locked); each sequence gets a copy of the compiled matcher.
- A constraint is bounded by llguidance's deterministic limits (`LIMITS`: work counted as
  fuel and items, not wall-clock time, so a constraint fails alike on every machine), at
  compile and for its first token's mask, which `compile` computes: one that needs more
  is refused with the limit named, before any request uses it.
- A sequence's matcher advances in exactly one place, when the engine appends a sampled
  token (`LLMEngine._append_tokens`), so its state always equals the generated tokens -
  recomputing a preempted sequence's KV cache never touches it.
- A step's masks are filled in one call for all its constrained rows, when the step's
  SamplingBatch is built (`TokenBitmask`), and applied by the sampler as tensor ops.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tokenmill.engine.types.structured_outputs import StructuredOutputs

MAX_COMPILED = 512  # distinct constraints kept compiled per process
# llguidance's `LLParserLimits` for every constraint (its own defaults, stated here so an
# error can name the one that was passed): name -> (value, what it bounds).
LIMITS = {
    "max_grammar_size": (500_000, "grammar size, in symbols"),
    "initial_lexer_fuel": (1_000_000, "compile fuel, in lexer expressions built"),
    "step_lexer_fuel": (200_000, "lexer fuel per token mask"),
    "step_max_items": (50_000, "parser items per token mask"),
    "max_lexer_states": (250_000, "lexer states, about 1-2 kB each: the masks' memory"),
}
# llguidance's error text -> the limit it reports (its messages do not all name one).
_LIMIT_ERRORS = (
    ("too big", "initial_lexer_fuel"),
    ("too many expressions", "initial_lexer_fuel"),
    ("Too many items", "step_max_items"),
    ("grammar size", "max_grammar_size"),
    ("lexer states", "max_lexer_states"),
    ("fuel", "step_lexer_fuel"),
)
MAX_TOKENIZERS = 4
# Fill a step's masks in a worker thread while the model runs (docs/design.md,
# "Why llguidance").
OVERLAP_FILL = True


class CompiledGrammar:
    """A constraint compiled for one tokenizer: a pristine matcher to copy per sequence."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the constrained output."""
        return GrammarMatcher(self._matcher.deep_copy())


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """Whether the grammar can take nothing more: the next token can only be EOS."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """Whether the tokens so far are a complete match (EOS would be allowed)."""
        return self._matcher.is_accepting() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the constraint stopped the output (a limit passed while generating, a token
        it refused), or None."""
        if not self._matcher.is_error():
            return None
        return f"structured outputs: the constraint stopped: {_one_line(self._matcher.get_error())}"


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer, once per distinct constraint per process.

    Args:
        tokenizer_json: the tokenizer's `tokenizer.json` text.
        vocab_size: the model's vocabulary (its logits' width; may exceed the tokenizer's).
        eos_token_ids: the tokens that end a sequence; the grammar allows them at its end.
    """

    @classmethod
    def for_model(
        cls, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
    ) -> GrammarCompiler:
        """The compiler an engine for this model uses: the model's vocabulary, and the end
        tokens of its config and tokenizer together (as `LLMEngine.eos_token_ids`).

        Args:
            tokenizer: the engine Tokenizer (`backend`, `eos_token_ids`).
            vocab_size: the model's vocabulary (its logits' width).
            eos_token_ids: the model config's end tokens (the tokenizer's are added).
        """
        eos = set(eos_token_ids) | set(tokenizer.eos_token_ids)
        return cls(tokenizer.backend.to_str(), vocab_size, sorted(eos))

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_key = (
            hashlib.sha256(tokenizer_json.encode()).hexdigest(),
            vocab_size,
            tuple(sorted(eos_token_ids)),
        )
        self._tokenizer_json = tokenizer_json

    def compile(self, constraint: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar of `constraint` (cached by content).

        Raises:
            ValueError: the schema, regex or grammar is invalid, or uses a feature the
                engine cannot enforce; the message names it.
        """
        key = (self._tokenizer_key, constraint.key)
        with _LOCK:
            compiled = _COMPILED.get(key)
            if compiled is not None:
                _COMPILED.move_to_end(key)
                return compiled
        # Compiled outside the lock: two threads may compile the same constraint once each,
        # but a slow compile never blocks requests whose grammars are already cached.
        compiled = CompiledGrammar(self._compile(constraint))
        with _LOCK:
            _COMPILED[key] = compiled
            while len(_COMPILED) > MAX_COMPILED:
                _COMPILED.popitem(last=False)
        return compiled

    def _compile(self, constraint: StructuredOutputs) -> Any:
        import llguidance

        source = _grammar_source(constraint)
        tokenizer = self._lltokenizer()
        limits = parser_limits()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            source, tokenizer, limits=limits
        )
        if is_error or messages:
            # Warnings are refused too: each one says part of the constraint would not be
            # enforced (e.g. `Unimplemented keys: ["uniqueItems"]`).
            detail = "; ".join(_one_line(m) for m in messages) or "invalid"
            raise ValueError(f"structured outputs {_describe(constraint)}: {detail}")
        # log_level 0: llguidance's warnings quote the text being matched, i.e. outputs.
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
        if not matcher.is_error():
            problem = _first_step_error(matcher.deep_copy(), tokenizer)
            if problem is not None:
                raise ValueError(f"structured outputs {_describe(constraint)}: {problem}")
        if matcher.is_error():
            raise ValueError(
                f"structured outputs {_describe(constraint)}: {_one_line(matcher.get_error())}"
            )
        return matcher

    def _lltokenizer(self) -> Any:
        with _LOCK:
            tokenizer = _TOKENIZERS.get(self._tokenizer_key)
            if tokenizer is not None:
                return tokenizer
        import llguidance

        _, vocab_size, eos_ids = self._tokenizer_key
        try:
            tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids)
            )
        except Exception as error:  # llguidance raises plain exceptions for unknown formats
            raise ValueError(
                f"structured outputs are not available for this tokenizer: {error}"
            ) from error
        with _LOCK:
            _TOKENIZERS[self._tokenizer_key] = tokenizer
            while len(_TOKENIZERS) > MAX_TOKENIZERS:
                _TOKENIZERS.popitem(last=False)
        return tokenizer


_LOCK = threading.Lock()
_COMPILED: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
_TOKENIZERS: OrderedDict[tuple, Any] = OrderedDict()


def parser_limits() -> Any:
    """`LIMITS` as llguidance's LLParserLimits (errors in one line, showing no grammar)."""
    import llguidance

    values = {name: value for name, (value, _) in LIMITS.items()}
    return llguidance.LLParserLimits(**values, verbose_errors=False)


def _first_step_error(probe: Any, tokenizer: Any) -> str | None:
    """Why a constraint cannot take its first token, or None.

    Its first mask, and one step past the lowest token it allows, build the lexer's start:
    a constraint that cannot start (one with no value, `{"$ref": "#"}`) or runs past a
    limit there (a regex like `(a{1000}){1000}`) is refused at compile, not inside a
    decode step. The probe is a copy; the compiled matcher stays at its start.
    """
    mask = probe.compute_bitmask()
    if not probe.is_error():
        allowed = _first_allowed(mask, skip=set(tokenizer.eos_tokens))
        if allowed is not None:
            probe.consume_token(allowed)
    if probe.is_error():
        return f"cannot start: {_one_line(probe.get_error())}"
    return None


def _first_allowed(mask: bytes, *, skip: set[int]) -> int | None:
    """The lowest token id a bitmask allows, other than `skip`."""
    for index, byte in enumerate(mask):
        if byte:
            for bit in range(8):
                token = index * 8 + bit
                if byte >> bit & 1 and token not in skip:
                    return token
    return None


def _one_line(message: str) -> str:
    """llguidance's message in one line, naming the limit it reports where it is one."""
    line = message.strip().splitlines()[0] if message.strip() else "invalid"
    if line == "NoExtensionBias":
        return "no token can begin a value it accepts"
    for fragment, name in _LIMIT_ERRORS:
        if fragment in line:
            value, what = LIMITS[name]
            return f"{line} (limit: {what}, {value:,})"
    return line


def _grammar_source(constraint: StructuredOutputs) -> str:
    """The llguidance grammar text of a constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = constraint.kind
    if kind in ("json", "json_object"):
        schema = constraint.json if kind == "json" else {"type": "object"}
        if constraint.disable_additional_properties:
            schema = _closed_objects(schema)
        if not isinstance(schema, dict):  # the boolean schemas true and false
            schema = json.dumps(schema)
        options: dict[str, Any] = {}
        if constraint.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if constraint.whitespace_pattern is not None:
            options["whitespace_pattern"] = constraint.whitespace_pattern
        return LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes; non-ASCII stays as itself.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    try:
        lark = any_to_lark(constraint.grammar)  # GBNF is converted; Lark passes through
    except Exception as error:
        raise ValueError(f"structured outputs grammar: cannot read it: {error}") from None
    return LLMatcher.grammar_from_lark(lark)


def _closed_objects(schema: Any) -> Any:
    """A copy of `schema` where objects that allow any extra property allow none."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _describe(constraint: StructuredOutputs) -> str:
    names = {
        "json": "json schema",
        "json_object": "json_object",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }
    return names[constraint.kind]


# -- a step's masks ---------------------------------------------------------------------------


class TokenBitmask:
    """The allowed tokens of a step's constrained rows, one bit per token.

    Filling starts when the step's SamplingBatch is built - in a worker thread when
    OVERLAP_FILL, so it overlaps the forward pass (llguidance releases the GIL) - and
    the sampler applies it to the logits with `apply`.

    Args:
        matchers: per sampled row, its matcher or None for an unconstrained row.
        vocab_size: the logits' width.
        overlap: fill in the worker thread (default OVERLAP_FILL) or now, in this thread.
    """

    def __init__(
        self,
        matchers: list[GrammarMatcher | None],
        vocab_size: int,
        *,
        overlap: bool | None = None,
    ) -> None:
        rows = [i for i, m in enumerate(matchers) if m is not None]
        # Row i of the bitmask belongs to logits row rows[i]; a constrained row's mask is
        # never empty - a matcher in an error state allows EOS only.
        self.rows = rows
        self.bitmask = torch.empty(
            len(rows),
            (vocab_size + 31) // 32,
            dtype=torch.int32,
            pin_memory=torch.cuda.is_available(),  # so the copy to a GPU can be asynchronous
        )
        self.fill_s = 0.0  # filling, wherever it ran
        self.blocking_s = 0.0  # the step waited for the fill and applied the mask
        pairs = [(matchers[row]._matcher, i) for i, row in enumerate(rows)]
        self._future: Future | None = None
        if OVERLAP_FILL if overlap is None else overlap:
            self._future = _fill_worker().submit(self._fill, pairs)
        else:
            start = time.perf_counter()
            self._fill(pairs)
            self.blocking_s += time.perf_counter() - start

    def wait(self) -> torch.Tensor:
        """The filled bitmask [len(rows), ceil(vocab/32)] int32, on the CPU."""
        if self._future is not None:
            start = time.perf_counter()
            self._future.result()
            self._future = None
            self.blocking_s += time.perf_counter() - start
        return self.bitmask

    def apply(self, logits: torch.Tensor) -> None:
        """Mask logits [num_rows, vocab] in place (-inf where a row's grammar says no)."""
        bitmask = self.wait()
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask, self.rows)
        self.blocking_s += time.perf_counter() - start  # on a GPU: the launch only

    def _fill(self, pairs: list[tuple[Any, int]]) -> None:
        start = time.perf_counter()
        rows, words = self.bitmask.shape
        _executor().unsafe_compute_mask_ptr(pairs, self.bitmask.data_ptr(), words * 4, rows)
        self.fill_s = time.perf_counter() - start


# Row v: which of the 8 tokens of a bitmask byte of value v are banned (bit clear). Bit b
# of byte j is token 8*j + b: the little-endian byte view of the int32 bitmask words.
_BANNED_BY_BYTE = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0  # [256, 8]
_BANNED_BY_BYTE_ON: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens a row's grammar does not allow.

    Tensor ops on the logits' device, with no loop over rows or vocabulary: each bitmask
    byte looks up its 8 tokens' bans in a 256-row table (faster than shifting the bits out:
    docs/design.md, "Why llguidance").

    Args:
        logits: [num_rows, vocab] on any device.
        bitmask: [len(rows), ceil(vocab / 32)] int32 on the CPU; bit t of a row set means
            token t is allowed.
        rows: the logits rows the bitmask rows belong to, ascending.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    table = _BANNED_BY_BYTE_ON.get(device)
    if table is None:
        table = _BANNED_BY_BYTE_ON.setdefault(device, _BANNED_BY_BYTE.to(device))
    as_bytes = bitmask.to(device, non_blocking=True).view(torch.uint8).view(-1).int()
    banned = table.index_select(0, as_bytes).view(len(rows), -1)[:, :vocab]  # [n, vocab]
    if len(rows) == num_rows:
        logits.masked_fill_(banned, float("-inf"))
    else:
        index = torch.tensor(rows, device=device)
        masked = logits.index_select(0, index).masked_fill_(banned, float("-inf"))
        logits.index_copy_(0, index, masked)


_WORKER: ThreadPoolExecutor | None = None
_EXECUTOR: Any = None


def _fill_worker() -> ThreadPoolExecutor:
    global _WORKER
    with _LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-masks")
        return _WORKER


def _executor() -> Any:
    """llguidance's thread pool for filling many rows' masks at once (one per process)."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        return _EXECUTOR
