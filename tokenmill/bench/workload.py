"""Seeded benchmark workloads: the same preset is the same token ids in every run.

Prompts are token ids drawn uniformly from the tokenizer's ordinary vocabulary (special
tokens excluded), so every system sees exactly the same input without a tokenizer in the
loop. A workload mixes prompts that share a prefix (a few prefix groups) with unique
prompts; output lengths are fixed per request and generated with EOS ignored, so every
system produces exactly the same number of tokens.

`extract64` is the exception: real extraction prompts with a JSON schema
(tokenmill/bench/extract.py), run constrained and unconstrained.

`cap_workload` keeps a run at a large model to minutes: the first N requests of a
preset and/or each output cut to T tokens, the same prompts the whole preset starts
with, the caps recorded in the workload's spec.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tokenmill.bench.extract import build_extract_workload
from tokenmill.bench.image_workload import IMAGE_PRESETS
from tokenmill.bench.workload_data import Workload, ordinary_token_ids

__all__ = [
    "Workload",
    "load_preset",
    "cap_workload",
    "warmup_prompts",
    "build_workload",
    "PRESETS",
    "PRESET_NAMES",
]

IntRange = tuple[int, int]  # inclusive bounds, drawn uniformly


@dataclass(frozen=True)
class WorkloadSpec:
    """How to draw a workload.

    Args:
        name: the preset name.
        num_prompts: total number of requests.
        shared_fraction: share of the requests that belong to a prefix group.
        num_prefix_groups: the shared requests are split round-robin over this many groups.
        prefix_len: tokens of each group's shared prefix.
        suffix_len: unique tokens after the shared prefix.
        unique_len: length of a prompt outside any group.
        output_len: generated tokens per request (EOS ignored).
        chat: wrap each prompt in the model's chat template (user turn + assistant header);
            a group's prefix then includes the template's opening.
        shuffle: interleave shared and unique requests instead of grouping them.
        distinct_prefixes: give every "shared" request a prefix of its own (same lengths,
            nothing shared): the same token counts with no prefix-cache hits to be had.
        sequential: run the requests one at a time, each after the previous one finished
            (batch-1 decode), instead of handing the whole workload over at once.
        seed: the random seed; the spec plus the vocabulary fix every token.
        num_adapters: serve the requests with this many LoRA adapters, request i with
            adapter i mod num_adapters (tokenmill/bench/lora.py makes them); 0: none.
        adapter_rank: their rank, on every linear layer of the decoder.
    """

    name: str
    num_prompts: int
    shared_fraction: float = 0.0
    num_prefix_groups: int = 1
    prefix_len: int = 0
    suffix_len: IntRange = (0, 0)
    unique_len: IntRange = (64, 512)
    output_len: IntRange = (64, 64)
    chat: bool = False
    shuffle: bool = True
    distinct_prefixes: bool = False
    sequential: bool = False
    seed: int = 0
    num_adapters: int = 0
    adapter_rank: int = 16

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError("shared_fraction must be within [0, 1]")
        if self.num_prefix_groups < 1:
            raise ValueError("num_prefix_groups must be >= 1")
        for label, (lo, hi) in (
            ("suffix_len", self.suffix_len),
            ("unique_len", self.unique_len),
            ("output_len", self.output_len),
        ):
            if not 0 <= lo <= hi:
                raise ValueError(f"{label} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
        if self.output_len[0] < 1:
            raise ValueError("output_len must be at least 1 token")
        if self.num_shared and self.prefix_len + self.suffix_len[0] < 1:
            raise ValueError("a shared prompt needs at least one token")
        if self.unique_len[0] < 1 and self.num_shared < self.num_prompts:
            raise ValueError("a unique prompt needs at least one token")

    @property
    def num_shared(self) -> int:
        return round(self.num_prompts * self.shared_fraction)


# The issue-5 reference workload: a prefix-cached half and a length-spread half.
_MIXED64 = WorkloadSpec(
    "mixed64",
    num_prompts=64,
    shared_fraction=0.5,
    prefix_len=256,
    suffix_len=(64, 256),
    unique_len=(64, 512),
    output_len=(64, 64),
)

PRESETS: dict[str, WorkloadSpec] = {
    "mixed64": _MIXED64,
    # mixed64 x 16: enough work to keep a GPU busy for more than a blink.
    "mixed1k": replace(_MIXED64, name="mixed1k", num_prompts=1024),
    # Few long shared prefixes (system prompts, few-shot examples) and short questions.
    "prefix-heavy": WorkloadSpec(
        "prefix-heavy",
        num_prompts=64,
        shared_fraction=1.0,
        num_prefix_groups=4,
        prefix_len=512,
        suffix_len=(16, 64),
        output_len=(64, 64),
    ),
    # mixed64's token counts with nothing shared: what is left of a lead without the
    # prefix cache.
    "mixed64-noprefix": replace(_MIXED64, name="mixed64-noprefix", distinct_prefixes=True),
    # mixed64's rows spread evenly over 8 LoRA adapters of rank 16 on every linear layer:
    # compared with the base model and with merging each adapter in turn.
    "lora8": replace(_MIXED64, name="lora8", num_adapters=8, adapter_rank=16),
    # mixed64's shape in chat form, as `tokenmill run --messages-column` would send it.
    "chat64": replace(_MIXED64, name="chat64", chat=True),
    # Long prompts: 2k-8k tokens, half of them behind one of two 2,048-token prefixes -
    # prefill with attention over thousands of tokens, and KV caches of gigabytes at the
    # published shapes (tokenmill bench --shape). Every prompt and its output fit 8,192
    # positions, so the default model runs it too.
    "long16": WorkloadSpec(
        "long16",
        num_prompts=16,
        shared_fraction=0.5,
        num_prefix_groups=2,
        prefix_len=2048,
        suffix_len=(256, 2048),
        unique_len=(2048, 8000),
        output_len=(32, 32),
    ),
    # One sequence at a time, mostly decoding: where a batch engine has nothing to batch
    # (llama-bench's tg128 is the same measure without the short prompts).
    "single8": WorkloadSpec(
        "single8",
        num_prompts=8,
        unique_len=(16, 48),
        output_len=(128, 128),
        sequential=True,
    ),
    # Seconds on a tiny model: for tests and for checking an installation.
    "smoke": WorkloadSpec(
        "smoke",
        num_prompts=6,
        shared_fraction=0.5,
        prefix_len=32,
        suffix_len=(4, 16),
        unique_len=(8, 40),
        output_len=(8, 8),
    ),
}


# Every preset `tokenmill bench --preset` takes: the drawn ones, the structured one, the
# embedding ones (tokenmill/bench/embed_workload.py, run by embed_harness.py) and the image
# ones (image_workload.py, run by image_harness.py).
PRESET_NAMES = [*PRESETS, "extract64", "embed4k", "embed-smoke", *IMAGE_PRESETS]


def build_workload(
    spec: WorkloadSpec,
    token_pool: list[int],
    *,
    chat_wrap: tuple[list[int], list[int]] | None = None,
) -> Workload:
    """Draw the workload of `spec` from `token_pool`.

    Args:
        spec: what to draw.
        token_pool: the token ids prompts are made of (see `ordinary_token_ids`).
        chat_wrap: (opening ids, closing ids) of the chat template around a user turn;
            required when spec.chat.

    Returns:
        The workload; identical for identical arguments.
    """
    if not token_pool:
        raise ValueError("token_pool is empty")
    if spec.chat and chat_wrap is None:
        raise ValueError(f"preset {spec.name!r} is a chat workload: pass chat_wrap")
    # One generator per purpose, so changing e.g. the output lengths of a preset does not
    # change its prompts.
    tokens = random.Random(f"{spec.seed}:tokens")
    lengths = random.Random(f"{spec.seed}:lengths")
    order = random.Random(f"{spec.seed}:order")
    opening, closing = chat_wrap if spec.chat else ([], [])

    def draw(n: int) -> list[int]:
        return [token_pool[tokens.randrange(len(token_pool))] for _ in range(n)]

    prefixes = [draw(spec.prefix_len) for _ in range(spec.num_prefix_groups)]
    requests: list[tuple[list[int], int | None, int]] = []
    for i in range(spec.num_shared):
        group = i % spec.num_prefix_groups
        if spec.distinct_prefixes:  # the same lengths, a prefix of its own
            body = draw(spec.prefix_len) + draw(lengths.randint(*spec.suffix_len))
            requests.append((opening + body + closing, None, 0))
            continue
        body = prefixes[group] + draw(lengths.randint(*spec.suffix_len))
        requests.append((opening + body + closing, group, len(opening) + spec.prefix_len))
    for _ in range(spec.num_prompts - spec.num_shared):
        requests.append((opening + draw(lengths.randint(*spec.unique_len)) + closing, None, 0))
    output_lens = [lengths.randint(*spec.output_len) for _ in requests]
    if spec.shuffle:
        paired = list(zip(requests, output_lens))
        order.shuffle(paired)
        requests = [r for r, _ in paired]
        output_lens = [n for _, n in paired]
    return Workload(
        name=spec.name,
        prompt_ids=[r[0] for r in requests],
        output_lens=output_lens,
        prefix_group=[r[1] for r in requests],
        shared_len=[r[2] for r in requests],
        spec=asdict(spec),
        sequential=spec.sequential,
        adapters=[i % spec.num_adapters for i in range(len(requests))]
        if spec.num_adapters
        else None,
    )


def chat_wrap_ids(model_dir: str | Path) -> tuple[list[int], list[int]]:
    """Token ids the model's chat template puts before and after a user message.

    The template is rendered around a marker and the two sides are encoded separately,
    so the body's random ids are never merged with template text by the tokenizer.
    """
    from tokenmill.engine import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    marker = "\x00BODY\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    before, _, after = text.partition(marker)
    return (
        tokenizer.encode(before, add_special_tokens=False) if before else [],
        tokenizer.encode(after, add_special_tokens=False) if after else [],
    )


def load_preset(name: str, model_dir: str | Path, *, seed: int | None = None) -> Workload:
    """The workload of preset `name` for the model in `model_dir`.

    Args:
        name: a key of PRESETS.
        model_dir: HF-layout model directory (its tokenizer.json supplies the vocabulary).
        seed: override the preset's seed.

    Returns:
        The workload.
    """
    if name == "extract64":
        return build_extract_workload(model_dir, seed=seed or 0)
    try:
        spec = PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}"
        ) from None
    if seed is not None:
        spec = replace(spec, seed=seed)
    model_dir = Path(model_dir)
    pool = ordinary_token_ids(model_dir / "tokenizer.json")
    wrap = chat_wrap_ids(model_dir) if spec.chat else None
    return build_workload(spec, pool, chat_wrap=wrap)


def cap_workload(
    workload: Workload, *, rows: int | None = None, output_tokens: int | None = None
) -> Workload:
    """`workload` cut to its first `rows` requests (in the order they are submitted) and
    each output to at most `output_tokens`; None leaves that dimension whole.

    The prompts kept are unchanged, so a capped run's rows are a prefix of the full
    preset's. The caps are recorded in the spec (`rows_cap`, `output_tokens_cap`) and in
    the workload's token counts, which every report computes from the capped requests.

    Raises:
        ValueError: a cap below 1.
    """
    for label, cap in (("rows", rows), ("output_tokens", output_tokens)):
        if cap is not None and cap < 1:
            raise ValueError(f"{label} cap must be >= 1, got {cap}")
    if rows is None and output_tokens is None:
        return workload
    keep = slice(0, rows)
    output_lens = workload.output_lens[keep]
    if output_tokens is not None:
        output_lens = [min(n, output_tokens) for n in output_lens]
    return replace(
        workload,
        prompt_ids=workload.prompt_ids[keep],
        output_lens=output_lens,
        prefix_group=workload.prefix_group[keep],
        shared_len=workload.shared_len[keep],
        spec={**workload.spec, "rows_cap": rows, "output_tokens_cap": output_tokens},
        adapters=None if workload.adapters is None else workload.adapters[keep],
    )


def warmup_prompts(workload: Workload) -> list[list[int]]:
    """Two short prompts to warm a system up before its timed run.

    Each repeats one token, so no block of them can match a workload prompt in a prefix
    cache and the timed run starts from a cold cache.
    """
    token = workload.prompt_ids[0][0]
    return [[token] * 40, [token] * 24]
