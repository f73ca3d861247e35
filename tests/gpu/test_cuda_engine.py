"""The engine on CUDA (Triton attention, CUDA-graph decode, overlapped steps, sampling on
the device) against the CPU path and against itself with each of those switched off, on a
random-weight Llama (run with `pytest -m gpu tests/gpu`)."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import build_hf_model, run_all

from tokenmill.engine.api.llm import build_engine
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model(
        "llama",
        path,
        vocab_size=512,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
    )
    return path


def make(model_dir, device: str, dtype=torch.float32, **config):
    settings = dict(block_size=16, kv_cache_memory=64 << 20, max_num_batched_tokens=256)
    settings.update(config)
    return build_engine(
        model_dir, EngineConfig(**settings), dtype=dtype, device=torch.device(device)
    )


def prompts(num: int = 40, seed: int = 0) -> list[list[int]]:
    """Half behind a 70-token shared prefix, half unrelated; lengths up to ~300."""
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(70)]
    out = []
    for i in range(num):
        tail = [rng.randrange(512) for _ in range(rng.randrange(1, 230))]
        out.append(shared + tail if i % 2 else tail)
    return out


def ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_cuda_fp32_greedy_equals_the_cpu_path(model_dir):
    batch = prompts()
    cpu = ids(run_all(make(model_dir, "cpu"), batch, GREEDY))
    gpu_engine = make(model_dir, "cuda")
    assert gpu_engine.runner.attention.name == "triton"
    assert gpu_engine.runner.decode_graphs is not None and gpu_engine.overlap_steps
    gpu = ids(run_all(gpu_engine, batch, GREEDY))
    same = sum(a == b for a, b in zip(cpu, gpu))
    assert same == len(batch), f"{same}/{len(batch)} sequences identical"


def test_graphs_and_overlap_change_nothing(model_dir):
    batch = prompts(seed=1)
    plain = ids(
        run_all(make(model_dir, "cuda", cuda_graphs=False, overlap_steps=False), batch, GREEDY)
    )
    engine = make(model_dir, "cuda")
    replays = []
    run = engine.runner.decode_graphs.run

    def counting(out, previous):
        replays.append(len(out.decodes))
        return run(out, previous)

    engine.runner.decode_graphs.run = counting
    fast = ids(run_all(engine, batch, GREEDY))
    assert len(replays) > 10 and len(set(replays)) > 3  # several bucket sizes replayed
    assert fast == plain


def test_seeded_sampling_is_independent_of_the_batch_on_cuda(model_dir):
    batch = prompts(12, seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
    alone = run_all(make(model_dir, "cuda"), batch[:1], params)[0].token_ids
    together = run_all(make(model_dir, "cuda"), batch, [params] + [GREEDY] * 11)[0].token_ids
    assert alone == together
