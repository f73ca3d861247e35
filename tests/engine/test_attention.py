"""Attention over the paged cache: the native kernel against float64 SDPA, its shared-
prefix groups against the same sequences alone, both engine paths against transformers,
and the portable path's bf16 prefill."""

from __future__ import annotations

import random
from importlib import resources

import numpy as np
import pytest
import torch
from hf_models import build_hf_model, hf_greedy, make_engine, run_all

from tokenmill.engine import kernels
from tokenmill.engine.kernels import native_library, paged_attention
from tokenmill.engine.kernels.paged_attention import (
    AttentionEntries,
    native_paged_attention,
    stores_pairs,
    to_native_layout,
    write_kv_cache,
)
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.worker.attention import portable as attention
from tokenmill.engine.worker.attention.portable import gather_key_blocks, gather_value_blocks
from tokenmill.engine.worker.attention.shared_prefix import group_shared_prefixes


@pytest.fixture(autouse=True, scope="module")
def _kernel_built():
    if native_library() is None:
        pytest.fail("the native kernel did not build; is a C compiler installed?")


class Cache:
    """A random paged cache and helpers to lay sequences out in it."""

    def __init__(self, dtype, num_kv_heads, head_dim, block_size, num_blocks=400, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        shape_k = (num_blocks, num_kv_heads, head_dim, block_size)
        shape_v = (num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.randn(shape_k, generator=gen).to(dtype)
        self.v = torch.randn(shape_v, generator=gen).to(dtype)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks

    @property
    def native(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same cache as the native kernels keep it (bf16 dot products' pair layout
        where they use one; `reference` reads the plain tensors)."""
        return to_native_layout(self.k, self.v)

    def table(self, num_positions: int, prefix: list[int] = ()) -> list[int]:
        """Blocks for num_positions positions, starting with the blocks in prefix."""
        needed = -(-num_positions // self.block_size) - len(prefix)
        return list(prefix) + [self.free.pop() for _ in range(needed)]


def entries_for(chunks, groups=None) -> AttentionEntries:
    """chunks: (first row, queries, context, table) each; groups: (entry indices,
    shared blocks) in order, or None for each entry alone."""
    groups = groups or [([i], 0) for i in range(len(chunks))]
    order = [i for members, _ in groups for i in members]
    width = max(len(chunks[i][3]) for i in order)
    tables = np.zeros((len(order), width), dtype=np.int64)
    for row, i in enumerate(order):
        tables[row, : len(chunks[i][3])] = chunks[i][3]
    starts = np.cumsum([0] + [len(members) for members, _ in groups])

    def t(values):
        return torch.tensor(np.asarray(values), dtype=torch.int64)

    return AttentionEntries(
        rows=t([chunks[i][0] for i in order]),
        queries=t([chunks[i][1] for i in order]),
        contexts=t([chunks[i][2] for i in order]),
        block_tables=torch.from_numpy(tables),
        group_starts=t(starts),
        group_shared_blocks=t([shared for _, shared in groups]),
    )


def reference(q, cache: Cache, chunks, scale, window=None):
    """Causal attention per chunk in float64, on copies gathered out of the cache; with a
    window, position p sees (p - window, p] (transformers' sliding_window_overlay)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for first, queries, context, table in chunks:
        ids = torch.tensor([table])
        k = gather_key_blocks(cache.k, ids)[0, :, :context].double()
        v = gather_value_blocks(cache.v, ids)[0, :, :context].double()
        qc = q[first : first + queries].transpose(0, 1).double()
        positions = torch.arange(context)
        mask = positions[None, :] <= positions[context - queries :, None]
        if window is not None:
            mask &= positions[None, :] > positions[context - queries :, None] - window
        o = torch.nn.functional.scaled_dot_product_attention(
            qc[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[first : first + queries] = o[0].transpose(0, 1)
    return out


def reference_tolerance(dtype, head_dim: int, scale: float) -> float:
    """How far the kernel may sit from float64. In float32 a score's rounding grows with
    |q| |k| scale, about head_dim * scale for unit normals, and the softmax carries it
    into the output; bf16 rounds the inputs' products the same way but the output once
    more."""
    if dtype == torch.bfloat16:
        return 1.5e-2
    return max(1e-5, 8 * torch.finfo(torch.float32).eps * head_dim * scale)


def layout(cache: Cache, shapes):
    """(queries, context) per chunk -> chunks with rows assigned in order and tables."""
    chunks, row = [], 0
    for queries, context in shapes:
        chunks.append((row, queries, context, cache.table(context)))
        row += queries
    return chunks, row


# Prompt chunks whole and continuing cached context, across tile edges (16 tokens per
# tile at 3 heads per kv head), a one-token chunk and long decode contexts.
SHAPES = [(40, 40), (17, 50), (1, 77), (5, 5), (33, 100), (2, 9), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"),
    [
        (3, 64, 16),  # the vectorized paths (SmolLM2's shape)
        (4, 128, 16),  # wide heads: 8 vectors per value row
        (4, 256, 16),  # Gemma 3's heads: query rows wider than the free AMX tiles
        (1, 64, 16),  # one query head per kv head: 48 tokens per tile
        (8, 32, 16),  # generic value path
        (3, 64, 4),  # generic score path
        (2, 24, 7),  # generic everything, odd sizes
    ],
)
def test_kernel_matches_float64_reference(dtype, group, head_dim, block_size):
    num_kv_heads = 2
    cache = Cache(dtype, num_kv_heads, head_dim, block_size)
    chunks, num_tokens = layout(cache, SHAPES)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim).to(dtype)
    got = native_paged_attention(q, *cache.native, entries_for(chunks), 0.2)
    want = reference(q, cache, chunks, 0.2)
    atol = reference_tolerance(dtype, head_dim, 0.2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
    # Rows past the first chunk differ from it: a mix-up of rows or heads would show.
    assert (want[:40] - want[40:80]).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (4, 128), (4, 256)])
def test_positions_past_a_sequence_are_never_read(dtype, group, head_dim):
    """A cache block holds whatever was there past a sequence's last token: NaN there must
    not reach the output (a zero weight times NaN is NaN, so every path - vector and
    AMX tiles - clears a partial last value block before its products)."""
    num_kv_heads, block_size = 2, 16
    cache = Cache(dtype, num_kv_heads, head_dim, block_size)
    chunks, num_tokens = layout(cache, SHAPES)
    for _first, _queries, context, table in chunks:
        if context % block_size:
            last = table[-1]
            cache.k[last, :, :, context % block_size :] = float("nan")
            cache.v[last, :, context % block_size :] = float("nan")
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim).to(dtype)
    got = native_paged_attention(q, *cache.native, entries_for(chunks), 0.2)
    want = reference(q, cache, chunks, 0.2)
    assert not got.isnan().any()
    atol = reference_tolerance(dtype, head_dim, 0.2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)


def long_prompt(cache: Cache):
    """Long contexts across many 512-position windows, none a whole number of blocks: one
    prompt computed in three chunks (each reading the earlier ones from the cache), one
    whole prompt and a decode after it. Positions past each sequence are NaN."""
    first, second = cache.table(1348), cache.table(1001)
    chunks = [
        (0, 700, 700, first),
        (700, 611, 1311, first),
        (1311, 37, 1348, first),
        (1348, 1000, 1000, second),
        (2348, 1, 1001, second),
    ]
    for context, table in ((1348, first), (1001, second)):
        cache.k[table[-1], :, :, context % cache.block_size :] = float("nan")
        cache.v[table[-1], :, context % cache.block_size :] = float("nan")
    return chunks, 2349


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "head_dim"),
    [(6, 128), (3, 64), (4, 256), (7, 64)],  # Qwen2.5-1.5B, SmolLM2, Gemma 3, ragged tiles
)
@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (300, False), (None, True)])
def test_long_prompts_in_chunks_match_float64_reference(dtype, group, head_dim, window, with_sinks):
    """Prompts of 1,000-1,348 tokens, whole and in chunks: on AMX, prompt tiles walk their
    keys in windows with an online softmax (attention_flash.h), which must give the
    softmax over every position seen - with sliding windows that start inside a window,
    sinks, heads per kv head that leave a tile's last AMX rows empty, and NaN past each
    sequence's end never read."""
    cache = Cache(dtype, 2, head_dim, 16, num_blocks=160, seed=5)
    chunks, num_tokens = long_prompt(cache)
    q = torch.randn(num_tokens, 2 * group, head_dim).to(dtype)
    sinks = torch.linspace(-1.0, 4.0, 2 * group) if with_sinks else None
    got = native_paged_attention(q, *cache.native, entries_for(chunks), 0.1, window, sinks)
    if with_sinks:
        want = reference_with_sinks(q, cache, chunks, 0.1, sinks, window)
    else:
        want = reference(q, cache, chunks, 0.1, window)
    assert not got.isnan().any()
    atol = reference_tolerance(dtype, head_dim, 0.1)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
    # Rows of one sequence differ from the other's: a mix-up of tables or rows would show.
    assert (want[:700] - want[1348:2048]).abs().max() > 0.05


@pytest.mark.parametrize(
    "flags",
    [
        ("-mno-avx512bf16",),  # AVX-512 without AVX512-BF16: bf16 widens to fp32
        ("-march=x86-64-v3",),  # AVX2 and FMA (Zen 1): the AVX2 micro-kernels
        ("-march=x86-64-v2",),  # no AVX at all: the generic loops
    ],
)
def test_kernel_built_for_other_cpus_matches_reference(flags, tmp_path, monkeypatch):
    """Build the variants other CPUs get and check them the same way."""
    with resources.as_file(resources.files(kernels)) as source_dir:
        kernels._compile(source_dir, tmp_path / "lib.so", extra_flags=flags)
    variant = kernels._load(tmp_path / "lib.so")
    monkeypatch.setattr(paged_attention, "_library", lambda: variant)
    for dtype in (torch.float32, torch.bfloat16):
        atol = reference_tolerance(dtype, 64, 0.2)
        cache = Cache(dtype, 2, 64, 16)
        chunks, num_tokens = layout(cache, SHAPES)
        q = torch.randn(num_tokens, 6, 64).to(dtype)
        got = native_paged_attention(q, *cache.native, entries_for(chunks), 0.2)
        want = reference(q, cache, chunks, 0.2)
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"), [(3, 64, 16), (4, 128, 16), (4, 256, 16), (2, 24, 7)]
)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window_matches_float64_reference(dtype, group, head_dim, block_size, window):
    """Each query sees only the last `window` positions: shorter than a block, exactly a
    block, and across several, for whole prompts, continued chunks and decodes."""
    cache = Cache(dtype, 2, head_dim, block_size)
    chunks, num_tokens = layout(cache, SHAPES)
    q = torch.randn(num_tokens, 2 * group, head_dim).to(dtype)
    got = native_paged_attention(q, *cache.native, entries_for(chunks), 0.2, window)
    want = reference(q, cache, chunks, 0.2, window)
    atol = reference_tolerance(dtype, head_dim, 0.2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
    # The window changes the answer wherever a query has more than `window` positions.
    full = reference(q, cache, chunks, 0.2)
    assert (want[57] - full[57]).abs().max() > 0.05  # the decode over 77 positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 2 * 16 + 4, 5 * 16 + 2])
def test_sliding_window_in_a_shared_prefix_group(dtype, window):
    """Decoding sequences grouped over a 5-block shared prefix, under windows that end
    inside the prefix for some members and past it for all: the group gives what each
    sequence gives alone, and the float64 reference."""
    block_size, num_kv_heads = 16, 2
    cache = Cache(dtype, num_kv_heads, 64, block_size, seed=3)
    prefix = cache.table(5 * block_size)
    chunks = []
    for row, extra in enumerate((0, 1, 9, 2 * block_size + 5, 40)):
        context = 5 * block_size + extra
        chunks.append((row, 1, context, cache.table(context, prefix)))
    q = torch.randn(len(chunks), num_kv_heads * 3, 64).to(dtype)
    alone = native_paged_attention(q, *cache.native, entries_for(chunks), 0.125, window)
    grouped_entries = entries_for(chunks, [(list(range(len(chunks))), 5)])
    grouped = native_paged_attention(q, *cache.native, grouped_entries, 0.125, window)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(grouped, alone, atol=tolerance, rtol=tolerance)
    atol = reference_tolerance(dtype, 64, 0.125)
    want = reference(q, cache, chunks, 0.125, window)
    torch.testing.assert_close(grouped.double(), want, atol=atol, rtol=atol)


def reference_with_sinks(q, cache: Cache, chunks, scale, sinks, window=None):
    """`reference` with a sink per query head: one more logit in each row's softmax, its
    weight dropped (transformers' gpt-oss eager attention), in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.k.shape[1]
    for first, queries, context, table in chunks:
        ids = torch.tensor([table])
        k = gather_key_blocks(cache.k, ids)[0, :, :context].double().repeat_interleave(group, 0)
        v = gather_value_blocks(cache.v, ids)[0, :, :context].double().repeat_interleave(group, 0)
        qc = q[first : first + queries].transpose(0, 1).double()
        positions = torch.arange(context)
        seen = positions[None, :] <= positions[context - queries :, None]
        if window is not None:
            seen &= positions[None, :] > positions[context - queries :, None] - window
        scores = (qc @ k.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
        sink = sinks.double()[:, None, None].expand(-1, queries, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[first : first + queries] = (probs @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 16), (2, 24, 7)])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_float64_reference(dtype, group, head_dim, block_size, window):
    """gpt-oss's attention sinks: each query head's softmax has its sink's logit in the
    denominator - for whole prompts, continued chunks and decodes, with and without a
    window - and without sinks the answer is another one."""
    cache = Cache(dtype, 2, head_dim, block_size)
    chunks, num_tokens = layout(cache, SHAPES)
    q = torch.randn(num_tokens, 2 * group, head_dim).to(dtype)
    sinks = torch.linspace(-2.0, 3.0, 2 * group)
    got = native_paged_attention(q, *cache.native, entries_for(chunks), 0.2, window, sinks)
    want = reference_with_sinks(q, cache, chunks, 0.2, sinks, window)
    atol = reference_tolerance(dtype, head_dim, 0.2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
    assert (want - reference(q, cache, chunks, 0.2, window)).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_in_a_shared_prefix_group(dtype):
    """Decoding sequences grouped over a shared prefix take each query head's own sink."""
    block_size, num_kv_heads = 16, 2
    cache = Cache(dtype, num_kv_heads, 64, block_size, seed=4)
    prefix = cache.table(3 * block_size)
    chunks = []
    for row, extra in enumerate((0, 1, 9, 20)):
        context = 3 * block_size + extra
        chunks.append((row, 1, context, cache.table(context, prefix)))
    q = torch.randn(len(chunks), num_kv_heads * 3, 64).to(dtype)
    sinks = torch.linspace(-1.0, 2.0, num_kv_heads * 3)
    grouped_entries = entries_for(chunks, [(list(range(len(chunks))), 3)])
    grouped = native_paged_attention(q, *cache.native, grouped_entries, 0.125, None, sinks)
    atol = reference_tolerance(dtype, 64, 0.125)
    want = reference_with_sinks(q, cache, chunks, 0.125, sinks)
    torch.testing.assert_close(grouped.double(), want, atol=atol, rtol=atol)


def test_sinks_must_be_one_per_query_head():
    cache = Cache(torch.float32, 1, 8, 16)
    chunks, num_tokens = layout(cache, [(3, 3)])
    q = torch.randn(num_tokens, 2, 8)
    with pytest.raises(ValueError, match=r"one per query head \(2\), not \(3,\)"):
        native_paged_attention(q, *cache.native, entries_for(chunks), 0.3, None, torch.ones(3))


def test_sliding_window_must_be_positive():
    cache = Cache(torch.float32, 1, 8, 16)
    chunks, num_tokens = layout(cache, [(3, 3)])
    q = torch.randn(num_tokens, 1, 8)
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        native_paged_attention(q, *cache.native, entries_for(chunks), 0.3, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
def test_shared_prefix_group_matches_sequences_alone(dtype, block_size):
    """Decoding sequences that share leading blocks, attended as one group (the shared
    blocks read once), give what each gives alone; so does a prompt chunk next to them."""
    group, head_dim, num_kv_heads = 3, 64, 3
    cache = Cache(dtype, num_kv_heads, head_dim, block_size, seed=1)
    prefix = cache.table(5 * block_size)
    chunks, row = [], 0
    for extra in (0, 1, 3, 11, 2 * block_size + 5, 40):  # some end exactly at the prefix
        context = 5 * block_size + extra
        chunks.append((row, 1, context, cache.table(context, prefix)))
        row += 1
    chunks.append((row, 20, 30, cache.table(30)))
    q = torch.randn(row + 20, num_kv_heads * group, head_dim).to(dtype)
    alone = native_paged_attention(q, *cache.native, entries_for(chunks), 0.125)
    groups = [([6], 0), ([0, 1, 2, 3, 4, 5], 5)]
    grouped = native_paged_attention(q, *cache.native, entries_for(chunks, groups), 0.125)
    # The same sums in the same order; only a vectorized exp against its scalar tail
    # could round a last bit differently.
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(grouped, alone, atol=tolerance, rtol=tolerance)
    want = reference(q, cache, chunks, 0.125)
    atol = reference_tolerance(dtype, head_dim, 0.125)
    torch.testing.assert_close(grouped.double(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "block_size"), [(3, 16), (300, 16), (37, 5)])
def test_write_kv_cache_matches_indexed_assignment(dtype, num_tokens, block_size):
    """The native store puts every key and value where the portable path's indexed
    assignment does (300 tokens take the multi-threaded branch), and nothing else moves."""
    num_blocks, num_kv_heads, head_dim = 80, 3, 64
    cache = Cache(dtype, num_kv_heads, head_dim, block_size, num_blocks=num_blocks, seed=2)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    blocks, offsets = slots // block_size, slots % block_size
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    want_k, want_v = cache.k.clone(), cache.v.clone()
    want_k[blocks, :, :, offsets] = k
    want_v[blocks, :, offsets] = v
    got_k, got_v = cache.native
    write_kv_cache(k, v, got_k, got_v, blocks, offsets)
    # In the layout the kernels keep (the pair layout for bf16 16-token blocks here).
    want_k, want_v = to_native_layout(want_k, want_v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_bf16_caches_are_kept_in_the_documented_pair_layout(cpu_path):
    """Where the kernels attend with bf16 dot products, the cache holds key element d of
    position t at (d / 2) * 32 + t * 2 + d % 2 of its block, value element c at
    (t / 2) * 2 * head_dim + c * 2 + t % 2 (kernels.h) - no step re-lays a block."""
    head_dim, block_size = 64, 16
    pairs = stores_pairs(torch.bfloat16, block_size, head_dim)
    cpu_path("bf16 KV cache layout", "bf16 dot-product pairs" if pairs else "plain")
    native = native_library()
    amx = native is not None and native.limits.bf16_attention_amx
    math = "vdpbf16ps dot products" if pairs else "widened to fp32"
    cpu_path("bf16 attention", f"AMX tiles for 16-row groups, else {math}" if amx else math)
    assert stores_pairs(torch.bfloat16, 16, 32) is False  # no bf16 dot path for these
    assert stores_pairs(torch.float32, 16, 64) is False
    k_cache = torch.zeros(4, 2, head_dim, block_size, dtype=torch.bfloat16)
    v_cache = torch.zeros(4, 2, block_size, head_dim, dtype=torch.bfloat16)
    k = torch.arange(2 * head_dim, dtype=torch.float32).reshape(1, 2, head_dim).bfloat16()
    v = -k
    block, t = 3, 5
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([block]), torch.tensor([t]))
    flat_k, flat_v = k_cache[block, 1].flatten(), v_cache[block, 1].flatten()
    for d in (0, 1, 2, 37, 63):
        where_k = (d // 2) * 32 + t * 2 + d % 2 if pairs else d * block_size + t
        where_v = (t // 2) * 2 * head_dim + d * 2 + t % 2 if pairs else t * head_dim + d
        assert flat_k[where_k] == k[0, 1, d] and flat_v[where_v] == v[0, 1, d]
    assert int((k_cache != 0).sum()) == int((k != 0).sum())  # nothing else written


def test_group_shared_prefixes_finds_the_common_blocks():
    bs = 4
    tables = [
        np.array([7, 8, 9, 10]),
        np.array([7, 8, 9, 11, 12]),
        np.array([7, 8, 13]),
        np.array([5, 6]),
        np.array([7, 8, 9, 14]),
        np.array([20]),
    ]
    lens = [16, 19, 12, 8, 13, 3]  # the last sees no full block: never shared
    groups, alone = group_shared_prefixes(tables, lens, bs, max_members=8)
    assert [(sorted(g.members), g.shared_blocks) for g in groups] == [([0, 1, 2, 4], 2)]
    assert sorted(alone) == [3, 5]
    # Capped groups keep the members with the longest common prefix together.
    groups, alone = group_shared_prefixes(tables, lens, bs, max_members=3)
    assert [(sorted(g.members), g.shared_blocks) for g in groups] == [([0, 1, 4], 3)]
    assert sorted(alone) == [2, 3, 5]
    # A sequence sees its shared blocks only up to its own length.
    groups, _ = group_shared_prefixes([tables[0], tables[1]], [16, 9], bs, max_members=8)
    assert groups[0].shared_blocks == 2


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts sharing a 70-token prefix (several full blocks), and unrelated ones."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(70)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 30, 2, 50)]
    return prompts + [[rng.randrange(vocab) for _ in range(n)] for n in (3, 21, 90)]


@pytest.mark.parametrize("backend", ["native", "portable", "triton"])
def test_every_attention_path_matches_transformers(backend, tmp_path):
    """SmolLM2's attention shape (3 query heads per kv head, head_dim 64) with 16-token
    blocks, so the vectorized kernel paths and shared-prefix groups run end to end. The
    Triton kernels (the CUDA path) run here in Triton's interpreter (tests/conftest.py)."""
    hf = build_hf_model(
        "llama", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    engine = make_engine(
        tmp_path, block_size=16, max_num_batched_tokens=64, enable_prefix_caching=True
    )
    engine.runner.use_attention_backend(backend)
    steps = []
    build = engine.runner.attention.build

    def recording(step, out):
        meta = build(step, out)
        steps.append(meta)
        return meta

    engine.runner.attention.build = recording
    prompts = _prompts(256, seed=5)[: 4 if backend == "triton" else None]
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)[0]
    assert {type(meta).__name__ for meta in steps} == {f"{backend.capitalize()}Metadata"}
    if backend == "native":
        shared = [int(s) for meta in steps for s in meta.entries.group_shared_blocks]
        assert max(shared) >= 4, "no decode step read the shared prefix as a group"
    elif backend == "triton":
        assert any(meta.sequences.num_decodes for meta in steps)
        assert any(meta.sequences.tile_seqs.numel() for meta in steps)
    else:
        assert any(meta.prefills for meta in steps) and any(m.num_decode_tokens for m in steps)


@pytest.mark.parametrize("backend", ["native", "portable", "triton"])
def test_every_attention_path_honours_sliding_windows(backend, tmp_path):
    """Mistral with a 16-token window: prompts of up to 160 tokens in chunks of 32, after a
    70-token prefix shared through the prefix cache and read as a decode group, so every
    path's windows cross chunk edges, cached context and shared blocks."""
    hf = build_hf_model(
        "mistral",
        tmp_path,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=16,
    )
    engine = make_engine(
        tmp_path, block_size=16, max_num_batched_tokens=32, enable_prefix_caching=True
    )
    engine.runner.use_attention_backend(backend)
    prompts = _prompts(256, seed=7)[: 3 if backend == "triton" else None]
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 6)[0]
    assert engine.stats.cached_prompt_tokens > 0


def test_shapes_the_kernel_does_not_take_use_the_portable_path(tmp_path):
    """64 query heads on one kv head exceed a tile's 48 rows: the kernel refuses the
    shape, and the engine runs such a model on the portable path instead of failing."""
    cache = Cache(torch.float32, 1, 8, 16)
    chunks, num_tokens = layout(cache, [(3, 3)])
    q = torch.randn(num_tokens, 64, 8)
    with pytest.raises(ValueError, match="48 query heads per kv head"):
        native_paged_attention(q, *cache.native, entries_for(chunks), 0.3)
    hf = build_hf_model(
        "llama", tmp_path, hidden_size=128, num_attention_heads=64, num_key_value_heads=1
    )
    engine = make_engine(tmp_path, block_size=16)
    assert engine.runner.attention.name == "portable"
    prompts = _prompts(256, seed=6)[3:7]
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 4)[0]


@pytest.mark.parametrize(
    ("query_tile", "tile_bytes"), [(128, 16 << 20), (5, 16 << 20), (128, 2048)]
)
@pytest.mark.parametrize("num_cached", [0, 17])
@pytest.mark.parametrize("window", [None, 4, 30])
def test_prefill_by_matmul_matches_fp32_sdpa(
    monkeypatch, query_tile, tile_bytes, num_cached, window
):
    """Portable path, bf16 prefill chunks: causal over the chunk, after num_cached cached
    tokens, in one tile or in many (each skipping the columns after its last row)."""
    monkeypatch.setattr(attention, "QUERY_TILE", query_tile)
    monkeypatch.setattr(attention, "SCORES_TILE_BYTES", tile_bytes)
    torch.manual_seed(1)
    num_kv_heads, group, head_dim, num_query = 2, 3, 16, 23
    num_context = num_cached + num_query
    q = torch.randn(num_kv_heads * group, num_query, head_dim)
    k = torch.randn(num_kv_heads, num_context, head_dim)
    v = torch.randn(num_kv_heads, num_context, head_dim)
    positions = torch.arange(num_cached, num_context)[:, None]
    allowed = torch.arange(num_context)[None, :] <= positions
    if window:
        allowed &= torch.arange(num_context)[None, :] > positions - window

    def sdpa(mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask[None, None], scale=0.25, enable_gqa=True
        )[0]

    got = attention.prefill_attention_by_matmul(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), num_cached, 0.25, window
    ).float()
    torch.testing.assert_close(got, sdpa(allowed), atol=3e-2, rtol=3e-2)
    # A mask one position off (each query seeing one future token) is far outside that
    # tolerance, so the comparison would catch an off-by-one in the tiles' masking.
    one_ahead = torch.arange(num_context)[None, :] <= positions + 1
    assert (got - sdpa(one_ahead)).abs().max() > 0.3
    if window and num_context > window:  # so would a window one position wider
        wider = allowed | (torch.arange(num_context)[None, :] == positions - window)
        assert (got - sdpa(wider)).abs().max() > 0.1
