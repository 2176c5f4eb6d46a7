"""Request arrival process: gamma-distributed inter-arrival times.

Same model as ``vllm bench serve --request-rate R --burstiness B``: the gaps
between requests are Gamma(shape=B, scale=1/(R·B)), so their mean is 1/R s and
their coefficient of variation is 1/sqrt(B). B = 1 is a Poisson process
(exponential gaps); B < 1 is burstier; B > 1 is more regular; B = inf sends at
exactly 1/R s intervals. R = inf sends every request at t = 0.
"""

from __future__ import annotations

import math

import numpy as np


def sample_gaps(num: int, request_rate: float, burstiness: float = 1.0,
                rng: np.random.Generator | None = None) -> np.ndarray:
    """Draw ``num`` inter-arrival gaps in seconds.

    Args:
        num: number of gaps (one per request; the first request waits one gap).
        request_rate: mean arrival rate, requests/s (> 0; ``inf`` gives zeros).
        burstiness: gamma shape (> 0; ``inf`` gives constant gaps).
        rng: numpy generator (default: a fresh unseeded one).

    Returns:
        ``[num]`` float64 array of gaps, s.

    Raises:
        ValueError: when ``request_rate`` or ``burstiness`` is not positive.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 req/s, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num)
    if math.isinf(burstiness):
        return np.full(num, 1.0 / request_rate)
    rng = rng if rng is not None else np.random.default_rng()
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0,
                    seed: int | None = 0, normalize: bool = True) -> np.ndarray:
    """Send times of ``num`` requests, s after the benchmark start.

    Offsets are the cumulative sum of :func:`sample_gaps`. With ``normalize``
    (vLLM does the same), they are rescaled so the last request is sent at
    exactly ``num / request_rate`` s; this keeps the realised mean rate equal to
    the requested one for every seed without changing the gaps' shape
    (coefficient of variation).

    Args:
        num: number of requests.
        request_rate: requests/s; ``inf`` sends all at 0.
        burstiness: gamma shape, see module docstring.
        seed: seed for ``numpy.random.default_rng``.
        normalize: rescale to the target total duration.

    Returns:
        ``[num]`` non-decreasing float64 array, s.
    """
    if num <= 0:
        return np.zeros(0)
    gaps = sample_gaps(num, request_rate, burstiness, np.random.default_rng(seed))
    offsets = np.cumsum(gaps)
    if normalize and not math.isinf(request_rate) and offsets[-1] > 0:
        offsets *= (num / request_rate) / offsets[-1]
    return offsets
