"""The arrival process: gamma gaps with mean 1/rate and CV 1/sqrt(burstiness)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.arrivals import arrival_offsets, sample_gaps

N = 40_000


@pytest.mark.parametrize("burstiness, rate", [(1.0, 5.0), (4.0, 5.0), (0.5, 20.0)])
def test_gap_mean_and_cv(burstiness, rate):
    gaps = sample_gaps(N, rate, burstiness, np.random.default_rng(123))
    mean, cv = gaps.mean(), gaps.std() / gaps.mean()
    # Standard error of the mean is cv/sqrt(N) ≈ 0.5-0.7%; allow 4%.
    assert mean == pytest.approx(1.0 / rate, rel=0.04)
    # CV of Gamma(k) is 1/sqrt(k): 1 for Poisson, 0.5 for burstiness 4.
    assert cv == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.05)


def test_poisson_gaps_are_exponential():
    gaps = sample_gaps(N, 2.0, 1.0, np.random.default_rng(7))
    # P(gap > mean) = e^-1 for an exponential distribution
    assert (gaps > 0.5).mean() == pytest.approx(math.exp(-1), abs=0.015)


def test_offsets_normalized_and_reproducible():
    a = arrival_offsets(200, 10.0, 1.0, seed=3)
    b = arrival_offsets(200, 10.0, 1.0, seed=3)
    c = arrival_offsets(200, 10.0, 1.0, seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a[-1] == pytest.approx(200 / 10.0)          # last send at num/rate, as vLLM
    assert np.all(np.diff(a) >= 0)
    # same seed at another rate: same shape, scaled
    assert np.allclose(arrival_offsets(200, 20.0, 1.0, seed=3), a / 2)


def test_infinite_rate_and_burstiness():
    assert np.all(arrival_offsets(5, math.inf) == 0)
    g = sample_gaps(4, 4.0, math.inf)
    assert np.allclose(g, 0.25)


@pytest.mark.parametrize("rate, burst", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_invalid(rate, burst):
    with pytest.raises(ValueError):
        sample_gaps(3, rate, burst)
