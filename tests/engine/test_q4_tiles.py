"""The 4-bit GGUF linear on AMX bf16 tiles (kernels/q4_tiles.c): the product of bf16 rows
with the blocks' exact dequantized weights, summed in fp32 and rounded once to bf16, at
every row-group and block edge; rows and threads do not change its bits; and the gguf
layers take it for bf16 calls of TILES_MIN_ROWS rows up to EXPAND_MIN_ROWS."""

from __future__ import annotations

import pytest
import torch
from hf_models import run_all
from model_fixtures import write_tiny_gguf

from tokenmill.engine.api.llm import build_engine
from tokenmill.engine.kernels import q4_linear as native_q4
from tokenmill.engine.kernels.q4_linear import pack_q4_weight, q4_linear_tiles, tiles_available
from tokenmill.engine.loader.gguf_convert import convert_gguf
from tokenmill.engine.quant import gguf_linear
from tokenmill.engine.quant.gguf_linear import Q4Linear
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.sampling_params import SamplingParams


def random_blocks(n: int, k: int, affine: bool, seed: int):
    """q in 0..15 (both extremes present), fp16 scales of varied size, fp16 minimums."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[0], q[-1] = 15, 0
    scale = (torch.rand(n, k // 32, generator=gen) * 0.05 + 1e-4).half().float()
    scale[:, 0] *= 64  # a block far larger than its neighbours: a per-block slip shows
    minimum = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float() if affine else None
    return q, scale, minimum


def dequantized(q, scale, minimum) -> torch.Tensor:
    """The blocks' values in fp32, as gguf's dequantize computes them."""
    n, k = q.shape
    per = q.float().reshape(n, k // 32, 32)
    if minimum is None:
        return ((per - 8) * scale[..., None]).reshape(n, k)
    return (per * scale[..., None] + minimum[..., None]).reshape(n, k)


@pytest.fixture
def needs_tiles(cpu_path):
    available = tiles_available()
    cpu_path("4-bit GGUF linear, AMX tiles", "built" if available else "no AMX bf16 here")
    return available


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (80, 160), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 37, 256])
@pytest.mark.parametrize("affine", [False, True])
def test_the_tiles_product_is_the_float_product(n, k, rows, affine, needs_tiles):
    if not needs_tiles:
        return
    q, scale, minimum = random_blocks(n, k, affine, n + rows)
    bias = torch.randn(n) if rows % 2 else None
    weight = dequantized(q, scale, minimum)
    x = (torch.randn(rows, k) * torch.linspace(0.1, 4, k)).bfloat16()

    got = q4_linear_tiles(x, pack_q4_weight(q, scale, minimum, bias))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = x.double() @ weight.double().t()
    if bias is not None:
        want = want + bias.double()
    # The fp32 sum of exact products (k of them, and the bias): k roundings of at most
    # 2^-24 of the running magnitude; then one rounding to bf16 (half its unit).
    summed = k * 2.0**-24 * (x.double().abs() @ weight.double().abs().t() + 1)
    half_unit = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)
    assert bool(((got.double() - want).abs() <= half_unit + summed).all())
    # Nearly every output is the exact product rounded once to bf16.
    assert (got == want.float().bfloat16()).double().mean() > 0.98


@pytest.mark.parametrize("affine", [False, True])
def test_rows_and_threads_do_not_change_the_bits(affine, needs_tiles):
    """Each row's sums run in one fixed order whatever group it lands in: a call of many
    rows equals calls of 5 rows each, on one thread or on several."""
    if not needs_tiles:
        return
    packed = pack_q4_weight(*random_blocks(96, 320, affine, 7), torch.randn(96))
    x = (torch.randn(70, 320) * 3).bfloat16()
    whole = q4_linear_tiles(x, packed)
    pieces = torch.cat([q4_linear_tiles(x[i : i + 5], packed) for i in range(0, 70, 5)])
    assert torch.equal(whole, pieces)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(q4_linear_tiles(x, packed), whole)
    finally:
        torch.set_num_threads(threads)


def test_the_tiles_take_bf16_rows_only(needs_tiles):
    if not needs_tiles:
        return
    packed = pack_q4_weight(*random_blocks(32, 64, False, 3))
    with pytest.raises(ValueError, match="bf16 rows"):
        q4_linear_tiles(torch.randn(3, 64), packed)
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        q4_linear_tiles(torch.randn(3, 32).bfloat16(), packed)


def test_the_layer_takes_the_tiles_for_bf16_batches(needs_tiles):
    """A Q4Linear sends bf16 calls of TILES_MIN_ROWS rows (below EXPAND_MIN_ROWS) to the
    tiles where they run; fewer rows and fp32 rows keep the integer product."""
    if native_q4.native_q4_isa() is None:
        return
    q, scale, minimum = random_blocks(64, 128, False, 11)
    packed = pack_q4_weight(q, scale, minimum, torch.randn(64))
    layer = Q4Linear(packed)
    many = gguf_linear.TILES_MIN_ROWS
    assert many < gguf_linear.EXPAND_MIN_ROWS
    x = torch.randn(many, 128)
    assert torch.equal(layer(x), native_q4.q4_linear(x, packed))
    few = x[: many - 1].bfloat16()
    assert torch.equal(layer(few), native_q4.q4_linear(few, packed))
    if not needs_tiles:
        assert layer.tiles_min_rows is None
        return
    assert layer.tiles_min_rows == many
    batch = x.bfloat16()
    assert torch.equal(layer(batch), q4_linear_tiles(batch, packed))


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_a_bf16_engine_on_the_tiles_keeps_the_integer_products_tokens(
    quant_type, needs_tiles, tmp_path, monkeypatch
):
    """A tiny GGUF model in a bf16 engine with every 4-bit call on the tiles (the float
    product) gives the greedy tokens of the same engine on the integer product (8-bit
    activations per block), and prompt log-probs within their difference in rounding."""
    if not needs_tiles:
        return
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", quant_type=quant_type, hidden_size=64)
    model_dir = convert_gguf(tiny.path, tmp_path / "model")
    prompts = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3], [4] * 20]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)

    def engine(tiles_min_rows: int):
        monkeypatch.setattr(gguf_linear, "TILES_MIN_ROWS", tiles_min_rows)
        config = EngineConfig(block_size=4, kv_cache_memory=8 << 20, quantization="gguf")
        built = build_engine(
            model_dir, config, dtype=torch.bfloat16, device=torch.device("cpu"), tokenizer=None
        )
        layers = [m for m in built.runner.model.modules() if isinstance(m, Q4Linear)]
        assert layers and all(m.tiles_min_rows == tiles_min_rows for m in layers)
        return built

    tiles = run_all(engine(1), prompts, params)
    integer = run_all(engine(gguf_linear.EXPAND_MIN_ROWS), prompts, params)
    for ours, theirs in zip(tiles, integer):
        assert ours.token_ids == theirs.token_ids
        for got, want in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            for token, value in want.items():
                assert abs(got[token] - value) < 0.05
