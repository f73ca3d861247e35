"""The sampler's vocabulary-wide work: top-k/top-p on the best candidates equals filtering
the fully sorted vocabulary (wide nuclei included), banned ids, and seeded noise."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sample.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingBatch,
    apply_top_k_top_p,
)
from tokenmill.engine.types.sampling_params import SamplingParams


def reference_top_k_top_p(logits, top_k, top_p):
    """Filtering over the whole sorted vocabulary, row by row. top_p 1.0 keeps every
    token: a cumulative sum of 3,000 probabilities may round past 1.0 (it does with
    ATen's AVX2 kernels), which must not cut the tail."""
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        values, order = logits[row].sort(descending=True)
        k = int(top_k[row]) or len(values)
        values[k:] = float("-inf")
        if float(top_p[row]) < 1.0:
            probs = values.softmax(dim=-1)
            values[(probs.cumsum(dim=-1) - probs) >= float(top_p[row])] = float("-inf")
        out[row, order] = values
    return out


@pytest.mark.parametrize("vocab", [50, 3000])
def test_top_k_top_p_on_candidates_equals_the_full_sort(vocab):
    gen = torch.Generator().manual_seed(0)
    # Peaked rows and one flat row, whose 0.95 nucleus is wider than the candidates.
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor(
        [[4.0], [4.0], [2.0], [4.0], [0.01], [3.0]]
    )
    top_k = torch.tensor([0, 5, 0, 40, 0, 0])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.8, 0.95, 1.0])
    got = apply_top_k_top_p(logits.clone(), top_k, top_p)
    expected = reference_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got[~got.isinf()], expected[~expected.isinf()])
    assert torch.equal(got[2], logits[2]) and torch.equal(got[5], logits[5])  # unfiltered
    if vocab > TOP_P_CANDIDATES:
        assert int((~got[4].isinf()).sum()) > TOP_P_CANDIDATES  # the wide row, sorted whole


def _batch(params, generators=None, banned=None):
    generators = generators or [None] * len(params)
    banned = banned or [[] for _ in params]
    return SamplingBatch.build(params, generators, banned, torch.device("cpu"))


def test_banned_ids_are_never_sampled():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0
    batch = _batch([SamplingParams(temperature=0)] * 3, banned=[[7], [], [7, 3]])
    assert Sampler()(logits, batch).token_ids.tolist()[1] == 7
    assert logits[0, 7] == logits[2, 3] == float("-inf") and logits[1, 7] == 5.0


def test_seeded_rows_sample_the_same_whatever_the_batch():
    logits = torch.randn(1, 4000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.9)

    def sample(num_others: int) -> list[int]:
        """Five steps of one seeded row beside num_others unseeded ones."""
        gen = torch.Generator().manual_seed(42)
        sampler = Sampler(seed=num_others)
        tokens = []
        for _ in range(5):
            rows = torch.cat([logits, torch.randn(num_others, 4000)])
            batch = _batch([params] * (1 + num_others), [gen] + [None] * num_others)
            tokens.append(int(sampler(rows, batch).token_ids[0]))
        return tokens

    assert sample(0) == sample(3) == sample(7)
    assert len(set(sample(0))) > 1  # the stream moves on step by step


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().repeat(20_000, 1)
    batch = _batch([SamplingParams(temperature=1.0)] * 20_000)
    counts = torch.bincount(Sampler(seed=3)(logits, batch).token_ids, minlength=4)
    torch.testing.assert_close(counts / 20_000, probs, atol=0.015, rtol=0)
