from __future__ import annotations

import pytest

from tokenmill.pipelines.pricing import Prices, token_costs


def test_cost_split_exact():
    prices = Prices(input_per_1m=0.15, cached_input_per_1m=0.075, output_per_1m=0.6)
    c = token_costs(
        prices,
        prompt_tokens=1_234_567,
        cached_tokens=234_567,
        completion_tokens=345_678,
        num_requests=1000,
    )
    assert c.cost_input == 0.15  # 1,000,000 uncached x $0.15/1M
    assert c.cost_cached_input == 0.017592525  # 234,567 x 0.075 / 1e6
    assert c.cost_output == 0.2074068  # 345,678 x 0.6 / 1e6
    assert c.cost_total == 0.374999325
    assert c.cost_per_1k_requests == 0.374999325
    assert c.cost_per_1m_tokens == 0.237304548  # 0.374999325 / 1,580,245 x 1e6, rounded
    assert c.cost_device is None


def test_cached_price_defaults_to_input_price():
    c = token_costs(
        Prices(input_per_1m=2.0),
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=0,
        num_requests=1,
    )
    assert (c.cost_input, c.cost_cached_input) == (0.000012, 0.000008)


def test_device_hour_costs():
    c = token_costs(
        Prices(device_per_hour=3.6),
        prompt_tokens=500_000,
        cached_tokens=0,
        completion_tokens=500_000,
        num_requests=2000,
        device_seconds=100.0,
    )
    assert c.cost_device == 0.1
    assert c.device_cost_per_1k_requests == 0.05
    assert c.device_cost_per_1m_tokens == 0.1
    assert c.cost_total == 0.0


def test_zero_denominators_give_none():
    c = token_costs(
        Prices(input_per_1m=1.0),
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        num_requests=0,
    )
    assert c.cost_total == 0.0 and c.cost_per_1k_requests is None and c.cost_per_1m_tokens is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1", True])
def test_prices_validate(bad):
    with pytest.raises(ValueError):
        Prices(input_per_1m=bad)


def test_counts_validate():
    with pytest.raises(ValueError, match="cached_tokens"):
        token_costs(Prices(), prompt_tokens=1, cached_tokens=2, completion_tokens=0, num_requests=0)
