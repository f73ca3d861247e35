"""The native argmax gives torch.argmax's answer on every kind of row the sampler sees:
ties, NaNs, -inf (banned tokens), signed zeros, maxima at either end, any width."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.argmax import argmax_rows


@pytest.fixture(autouse=True, scope="module")
def _kernel_built():
    if native_library() is None:
        pytest.fail("the native kernels did not build; is a C compiler installed?")


@pytest.mark.parametrize("width", [1, 7, 8, 31, 32, 33, 100, 49152, 262144])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_random_rows(rows, width):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_the_rows_the_sampler_meets():
    width = 1000
    x = torch.randn(12, width, generator=torch.Generator().manual_seed(0))
    x[0, [3, 700]] = 50.0  # a tie: the first wins
    x[1, :] = float("-inf")  # every token banned
    x[2, 999] = 80.0  # the last position, in the scalar tail
    x[3, 0] = 80.0  # the first
    x[4, [10, 900]] = float("nan")  # NaN counts as the largest; the first one
    x[5, 998] = float("nan")
    x[6, :] = 0.0
    x[6, [5, 6]] = torch.tensor([-0.0, 0.0])  # signed zeros tie
    x[7, ::2] = float("-inf")
    x[8, 500] = float("inf")
    x[8, 20] = float("inf")
    x[9, 33] = torch.finfo(torch.float32).max
    x[10, 40:] = float("nan")
    x[11, :] = -1e30
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[4] == 10 and argmax_rows(x)[0] == 3


def test_views_and_other_tensors():
    x = torch.randn(6, 300)
    assert torch.equal(argmax_rows(x[:, 100:]), x[:, 100:].argmax(dim=-1))  # strided
    assert torch.equal(argmax_rows(x.double()), x.double().argmax(dim=-1))  # torch's path
    with pytest.raises(ValueError, match="empty"):
        argmax_rows(torch.empty(3, 0))
