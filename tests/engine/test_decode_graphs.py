"""CUDA-graph decode steps, minus the capture: a DecodeGraphs whose "replay" re-runs the
captured forward pass eagerly into the captured output, over the same static buffers, with
the Triton kernels in Triton's interpreter. Everything a graph step does on the host -
bucket choice, padding rows that store and see nothing, one packed upload, placeholder
tokens filled from the previous step - runs here on the CPU and must not change an
output; tests/gpu checks real capture on a device."""

from __future__ import annotations

import random

import pytest
from hf_models import build_hf_model, make_engine, run_all

from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs


class EagerReplay(DecodeGraphs):
    def _capture_one(self, size):
        hidden = self._forward(size)

        def replay():
            hidden.copy_(self._forward(size))

        return replay, hidden


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", path, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    return path


def test_graph_steps_compute_what_eager_steps_compute(model_dir):
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 60))]
        for i in range(7)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(2, 9), ignore_eos=True)
        for _ in prompts
    ]
    expected = run_all(make_engine(model_dir, block_size=16), prompts, params)

    engine = make_engine(model_dir, block_size=16, max_num_seqs=7, overlap_steps=True)
    runner = engine.runner
    runner.use_attention_backend("triton")
    runner.decode_graphs = EagerReplay(runner, max_num_seqs=7, max_model_len=512)
    assert runner.decode_graphs.sizes == [1, 2, 4, 7]
    replayed = []
    run = runner.decode_graphs.run

    def counting(out, previous):
        replayed.append(len(out.decodes))
        return run(out, previous)

    runner.decode_graphs.run = counting
    got = run_all(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    # Batches that fill a bucket exactly and batches padded up to the next one.
    sizes = set(runner.decode_graphs.sizes)
    assert set(replayed) & (sizes - {1}) and set(replayed) - sizes, replayed
