"""The int8 KV cache (kernels/kv_int8.h): the writer's quantization against a reference
quantizer, attention over it against the float path and the float64 reference, the
builds other CPUs get, and the engine on it."""

from __future__ import annotations

from importlib import resources

import pytest
import torch
from hf_models import build_hf_model, make_engine, run_all
from test_attention import SHAPES, Cache, entries_for, layout, reference

from tokenmill.engine import kernels
from tokenmill.engine.kernels import native_library, paged_attention
from tokenmill.engine.kernels.paged_attention import (
    kv_int8_head_bytes,
    native_paged_attention,
    write_kv_cache,
)
from tokenmill.engine.types.sampling_params import SamplingParams

GROUP = 32
# The int16 dot products' error (query rows and block weights in 15 bits, fp32 sums):
# where a build reads int8 caches directly, fp32 answers are this close, not bit-equal.
DIRECT_FP32_TOLERANCE = 1e-3


def direct() -> bool:
    """Whether the loaded build reads int8 caches in int16 dot products."""
    return paged_attention._library().limits.kv_int8_direct


@pytest.fixture(autouse=True, scope="module")
def _kernel_built():
    if native_library() is None:
        pytest.fail("the native kernel did not build; is a C compiler installed?")


def positions(cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's key and value rows, [num_blocks * block_size, num_kv_heads, head_dim]."""
    blocks, heads, head_dim, block_size = cache.k.shape
    k = cache.k.permute(0, 3, 1, 2).reshape(blocks * block_size, heads, head_dim)
    v = cache.v.permute(0, 2, 1, 3).reshape(blocks * block_size, heads, head_dim)
    return k, v


def set_positions(cache: Cache, k: torch.Tensor, v: torch.Tensor) -> None:
    blocks, heads, head_dim, block_size = cache.k.shape
    cache.k = k.reshape(blocks, block_size, heads, head_dim).permute(0, 2, 3, 1).contiguous()
    cache.v = v.reshape(blocks, block_size, heads, head_dim).permute(0, 2, 1, 3).contiguous()


def int8_copy(cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """cache's keys and values written through the native writer into int8 caches."""
    blocks, heads, head_dim, block_size = cache.k.shape
    shape = (blocks, heads, kv_int8_head_bytes(head_dim, block_size))
    k8, v8 = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    slots = torch.arange(blocks * block_size)
    write_kv_cache(*positions(cache), k8, v8, slots // block_size, slots % block_size)
    return k8, v8


def quantize_reference(x: torch.Tensor) -> torch.Tensor:
    """What an int8 cache holds for rows x, in fp32: per 32 values, scale = max|x| / 127
    and round(x * 127 / max|x|) * scale."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(groups * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).flatten(-2)


def representable(cache: Cache, seed: int) -> None:
    """Refill cache with values an int8 cache holds exactly: per position and group, ints
    in [-127, 127] reaching +-127, times a power of two (values up to 4, so that scores
    stay in the range real models give)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = positions(cache)

    def draw(like):
        ints = torch.randint(
            -127, 128, (*like.shape[:-1], like.shape[-1] // GROUP, GROUP), generator=gen
        )
        ints[..., 0] = 127 * (torch.randint(0, 2, ints.shape[:-1], generator=gen) * 2 - 1)
        scale = 2.0 ** torch.randint(-9, -4, (*ints.shape[:-1], 1), generator=gen)
        return (ints * scale).flatten(-2).to(like.dtype)

    set_positions(cache, draw(k), draw(v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (4, 128), (4, 256), (1, 64)])
@pytest.mark.parametrize("window", [None, 5, 37])
def test_int8_cache_of_exact_values_attends_as_the_float_cache(dtype, group, head_dim, window):
    """Values an int8 cache holds exactly give the float path's answer: to the bit where
    the kernel widens int8 blocks into exactly the float blocks and runs the same code on
    them; where the rows off the AMX tiles (all rows in fp32, or without AMX) read the
    int8 blocks in int16 dot products, to the float path's own accuracy against float64
    in bf16 and to the int16 products' in fp32 (long contexts, windows, partial last
    blocks)."""
    cache = Cache(dtype, 2, head_dim, 16, num_blocks=120)
    representable(cache, seed=head_dim + group)
    chunks, num_tokens = layout(cache, SHAPES + [(1, 700), (48, 260)])
    q = torch.randn(num_tokens, 2 * group, head_dim).to(dtype)
    entries = entries_for(chunks)
    want = native_paged_attention(q, *cache.native, entries, 0.2, window)
    got = native_paged_attention(q, *int8_copy(cache), entries, 0.2, window)
    if not direct():
        assert torch.equal(got, want)
        return
    exact = reference(q, cache, chunks, 0.2, window)
    tolerance = DIRECT_FP32_TOLERANCE if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(got.double(), exact, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(want.double(), exact, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (256, 16), (64, 5), (32, 7)])
def test_int8_cache_matches_float64_reference_on_the_quantized_values(dtype, head_dim, block_size):
    """Random keys and values: attention over the int8 cache equals the float64 reference
    over the reference quantizer's values (fp32), so the writer stored what it should and
    the reader read it (plain and pair layouts, generic block sizes). bf16 widens the
    values into bf16 for the tiles, which the reference does not: twice the float tests'
    tolerance, still far below what a wrong scale or position would give."""
    cache = Cache(dtype, 2, head_dim, block_size, num_blocks=200)
    chunks, num_tokens = layout(cache, SHAPES)
    q = torch.randn(num_tokens, 6, head_dim).to(dtype)
    k8, v8 = int8_copy(cache)
    got = native_paged_attention(q, k8, v8, entries_for(chunks), 0.2)
    k, v = positions(cache)
    set_positions(cache, quantize_reference(k), quantize_reference(v))
    want = reference(q, cache, chunks, 0.2)
    if dtype == torch.float32:  # widened exactly (the generic shapes), or int16 products
        atol = DIRECT_FP32_TOLERANCE if direct() and block_size == 16 else 1e-5
    else:
        atol = 3e-2
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 2 * 16 + 4])
def test_shared_prefix_group_on_an_int8_cache_matches_sequences_alone(dtype, window):
    """Decoding sequences grouped over a 5-block shared prefix (its blocks read once for
    all: 32 members x 3 heads put 96 rows on the AMX tiles, the rest go direct) give what
    each gives alone on the same int8 cache."""
    block_size, num_kv_heads, members = 16, 2, 32
    cache = Cache(dtype, num_kv_heads, 64, block_size, num_blocks=400, seed=4)
    prefix = cache.table(5 * block_size)
    chunks = []
    for row in range(members):
        context = 5 * block_size + row * 3
        chunks.append((row, 1, context, cache.table(context, prefix)))
    k8, v8 = int8_copy(cache)
    q = torch.randn(members, num_kv_heads * 3, 64).to(dtype)
    alone = native_paged_attention(q, k8, v8, entries_for(chunks), 0.125, window)
    grouped_entries = entries_for(chunks, [(list(range(members)), 5)])
    grouped = native_paged_attention(q, k8, v8, grouped_entries, 0.125, window)
    fp32 = DIRECT_FP32_TOLERANCE if direct() else 1e-5
    tolerance = fp32 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(grouped, alone, atol=tolerance, rtol=tolerance)
    k, v = positions(cache)
    set_positions(cache, quantize_reference(k), quantize_reference(v))
    want = reference(q, cache, chunks, 0.125, window)
    atol = fp32 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(grouped.double(), want, atol=atol, rtol=atol)


def test_quantization_error_is_within_half_a_step():
    """Read back through attention by a query that sees one position (its output is that
    position's value row), each value is its input within half its group's step
    (max|x| / 127), and not much closer: the values were quantized, not kept as floats."""
    head_dim, block_size = 64, 16
    cache = Cache(torch.float32, 1, head_dim, block_size, num_blocks=4)
    k8, v8 = int8_copy(cache)
    chunks = [(0, 1, 1, [2])]  # one query at position 0 of block 2: it sees only that value
    q = torch.zeros(1, 1, head_dim)
    got = native_paged_attention(q, k8, v8, entries_for(chunks), 1.0)[0, 0]
    value = cache.v[2, 0, 0]
    step = value.unflatten(0, (-1, GROUP)).abs().amax(-1).repeat_interleave(GROUP) / 127
    error = (got - value).abs()
    assert (error <= step / 2 * 1.0001).all()
    assert error.max() > step.max() / 20


def test_head_dims_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_int8_head_bytes(24, 16)


@pytest.mark.parametrize(
    "flags", [("-mno-avx512bf16",), ("-march=x86-64-v3",), ("-march=x86-64-v2",)]
)
def test_int8_cache_in_builds_for_other_cpus(flags, tmp_path, monkeypatch):
    """The builds other CPUs get (AVX512-VNNI without AVX512-BF16, and AVX2: int16 dot
    products in both dtypes; no AVX: widened) attend over an int8 cache of exact values as
    over the float cache - to the bit where they widen."""
    with resources.as_file(resources.files(kernels)) as source_dir:
        kernels._compile(source_dir, tmp_path / "lib.so", extra_flags=flags)
    variant = kernels._load(tmp_path / "lib.so")
    monkeypatch.setattr(paged_attention, "_library", lambda: variant)
    for dtype in (torch.float32, torch.bfloat16):
        cache = Cache(dtype, 2, 64, 16, num_blocks=120)
        representable(cache, seed=7)
        chunks, num_tokens = layout(cache, SHAPES)
        q = torch.randn(num_tokens, 6, 64).to(dtype)
        want = native_paged_attention(q, *cache.native, entries_for(chunks), 0.2)
        got = native_paged_attention(q, *int8_copy(cache), entries_for(chunks), 0.2)
        if not variant.limits.kv_int8_direct:
            assert torch.equal(got, want)
            continue
        exact = reference(q, cache, chunks, 0.2)
        tolerance = DIRECT_FP32_TOLERANCE if dtype == torch.float32 else 1.5e-2
        torch.testing.assert_close(got.double(), exact, atol=tolerance, rtol=tolerance)
    # x86-64-v3 has AVX2 and FMA, v2 no AVX; -mno-avx512bf16 keeps the base build's ISA
    base = native_library().limits.kv_int8_direct
    expected = {"-march=x86-64-v3": True, "-march=x86-64-v2": False}.get(flags[0], base)
    assert variant.limits.kv_int8_direct == expected


def _engine_prompts(seed: int) -> list[list[int]]:
    """A 70-token shared prefix (read as a decode group) and unrelated prompts."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    return prompts + [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 90)]


def _errors_against_transformers(hf, model_dir, dtype, kv_cache_dtype):
    """Each step's largest log-probability error against transformers (fp32, fed the
    engine's tokens, so one flipped near-tie does not derail the rest), and how many
    greedy tokens are transformers' own choice; prompts in chunks, a prefix from the
    prefix cache, decode groups."""
    from tokenmill.engine.api.llm import build_engine
    from tokenmill.engine.types.config import EngineConfig

    config = EngineConfig(
        block_size=16,
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=32,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = build_engine(model_dir, config, dtype=dtype, device=torch.device("cpu"))
    prompts = _engine_prompts(seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=256)
    errors, agreeing = [], 0
    for prompt, out in zip(prompts, run_all(engine, prompts, params)):
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), dim=-1)
        for step, entry in enumerate(out.outputs[0].logprobs):
            ours = torch.tensor([entry[t] for t in range(256)])
            errors.append((ours - want[step]).abs().max().item())
            agreeing += out.token_ids[step] == int(want[step].argmax())
    assert engine.stats.cached_prompt_tokens > 0
    return torch.tensor(errors), agreeing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_on_an_int8_cache_costs_what_bf16_costs(dtype, tmp_path):
    """End to end on SmolLM2's attention shape, an int8 cache moves log-probabilities
    about as much as running the model in bf16 does (this random-weight model amplifies
    both: ~0.4 at the median), and the greedy tokens stay transformers' choice. A wrong
    scale or position moves them by whole units."""
    hf = build_hf_model(
        "llama", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    int8_errors, int8_agreeing = _errors_against_transformers(hf, tmp_path, dtype, "int8")
    bf16_errors, _ = _errors_against_transformers(hf, tmp_path, torch.bfloat16, "auto")
    allowance = 1.3 if dtype == torch.float32 else 2.0  # bf16 adds its own rounding
    assert int8_errors.median() <= allowance * bf16_errors.median(), (int8_errors, bf16_errors)
    assert int8_errors.max() <= 2 * bf16_errors.max()
    assert int8_agreeing >= 36  # of 40


def test_an_int8_cache_holds_more_tokens_in_the_same_budget(tmp_path):
    """fp32 keys and values take 4 bytes, int8 ones 1 plus a 4-byte scale per 32."""
    build_hf_model(
        "llama", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    plain = make_engine(tmp_path, block_size=16)
    int8 = make_engine(tmp_path, block_size=16, kv_cache_dtype="int8")
    plain_blocks, int8_blocks = plain.block_manager.num_blocks, int8.block_manager.num_blocks
    # 8 MiB over 2 layers x 2 kv heads x (keys, values) x 16 positions x 64 values
    assert plain_blocks == (8 << 20) // (8 * 16 * 64 * 4)
    assert int8_blocks == (8 << 20) // (8 * (16 * 64 + 16 * 2 * 4))
    assert int8.runner.kv_cache.k.numel() <= (8 << 20) // 2


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        ({"head_dim": 24, "num_attention_heads": 4}, {"kv_cache_dtype": "int8"}, "multiple of 32"),
        ({}, {"kv_cache_dtype": "fp8"}, "unknown kv_cache_dtype"),
        ({}, {"kv_cache_dtype": "int8", "device": "cuda"}, "CPU only"),
    ],
)
def test_an_int8_cache_the_model_or_device_cannot_have_fails_before_loading(
    config, options, message, tmp_path, monkeypatch
):
    from tokenmill.engine.worker import build as llm_engine

    build_hf_model("llama", tmp_path, hidden_size=96, num_key_value_heads=2, **config)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the option was checked")

    monkeypatch.setattr(llm_engine, "load_model", no_loading)
    from tokenmill.engine.api.llm import build_engine
    from tokenmill.engine.types.config import EngineConfig

    device = torch.device(options.pop("device", "cpu"))
    with pytest.raises(ValueError, match=message):
        build_engine(
            tmp_path, EngineConfig(block_size=16, **options), dtype=torch.float32, device=device
        )
