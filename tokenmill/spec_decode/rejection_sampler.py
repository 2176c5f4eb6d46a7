"""Lossless verification of draft tokens (Leviathan et al., arXiv 2211.17192, §2.3 and Appendix A.1).

The target scores a request's last token and its ``k`` drafts in one pass,
giving ``k + 1`` rows of logits; row ``j`` is the target's distribution
``p_j`` for the token after the last token and drafts ``d_1 .. d_j``.

* **One-hot drafts** (n-gram lookup, and any greedy request): every row is
  sampled by the ordinary :class:`~tokenmill.model.sampler.Sampler` (row ``j``
  as if ``d_1 .. d_j`` were already output: penalties see them, a seeded
  request's uniform is the one for that output index), giving ``y_0 .. y_k``;
  the request keeps ``y_0 .. y_a`` where ``a`` is the first ``j`` with
  ``y_j != d_{j+1}`` (or ``k``: the bonus token). For a one-hot ``q`` this is
  exactly the paper's rule: draft ``d`` is accepted with probability
  ``p(d) = min(1, p(d) / q(d))``, and on rejection the token comes from
  ``p`` restricted to ``x != d``, which is ``norm(max(0, p - q))``. Greedy
  requests thus accept while the draft equals the argmax and then take the
  target's token; a seeded request emits bit for bit the tokens it would
  emit without speculation (same logits), whatever the batch or draft length.
* **Drafts sampled from a distribution q** (the draft model, non-greedy
  requests): draft ``d_j`` is accepted when ``u < p(d_j) / q(d_j)``; at the
  first rejection the token is drawn from ``norm(max(0, p_j - q_j))``; when
  all ``k`` are accepted the bonus token ``y_k`` is drawn from ``p_k``.

Acceptance uniforms of a seeded request depend only on ``(seed, output
index)`` (a salted SplitMix64 hash), so results do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain

import numpy as np
import torch

from tokenmill.model.sampler import Sampler, _mix_seed

# Salts that separate the acceptance / draft uniforms of a seeded request from its sampling uniforms.
ACCEPT_SALT = 0x5EC0DE_ACCE
DRAFT_SALT = 0x5EC0DE_D8AF


class ExtendedTokens(Sequence):
    """``base + extra`` as a read-only sequence without copying ``base`` (a request's output plus drafts)."""

    __slots__ = ("base", "extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __iter__(self) -> Iterator[int]:
        return chain(self.base, self.extra)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self.base)
        if i < 0:
            i += len(self)
        return self.base[i] if i < n else self.extra[i - n]


class VerifyRow:
    """One row to verify: what the sampler needs of a request, with ``drafts[:j]`` appended to its output.

    Attributes:
        sampling_params, prompt_token_ids: the request's.
        output_token_ids: the request's output followed by the first ``j`` drafts.
    """

    __slots__ = ("sampling_params", "prompt_token_ids", "output_token_ids", "req_id")

    def __init__(self, req, drafts: Sequence[int], j: int) -> None:
        self.req_id = req.req_id
        self.sampling_params = req.sampling_params
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids = ExtendedTokens(req.output_token_ids, drafts[:j]) if j else req.output_token_ids


def expand_rows(reqs: Sequence) -> list[VerifyRow]:
    """``len(r.spec_token_ids) + 1`` rows per request, in order (row ``j`` sees drafts ``[:j]``)."""
    return [VerifyRow(r, r.spec_token_ids, j) for r in reqs for j in range(len(r.spec_token_ids) + 1)]


def num_accepted_one_hot(sampled: np.ndarray, drafts: Sequence[Sequence[int]]) -> np.ndarray:
    """Accepted drafts per request when each row was sampled from the target.

    Args:
        sampled: ``[sum(k_i + 1)]`` int, the token sampled at every row
            (request ``i`` owns ``k_i + 1`` consecutive rows).
        drafts: per request its ``k_i`` draft tokens.

    Returns:
        ``[B]`` int64: the first ``j`` with ``sampled[i, j] != drafts[i][j]``, or ``k_i``.
    """
    B = len(drafts)
    ks = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=B)
    kmax = int(ks.max()) if B else 0
    if kmax == 0:
        return np.zeros(B, dtype=np.int64)
    starts = np.cumsum(ks + 1) - (ks + 1)
    j = np.arange(kmax)
    valid = j[None, :] < ks[:, None]                                   # [B, kmax]
    rows = np.where(valid, starts[:, None] + j[None, :], 0)
    d = np.full((B, kmax), -1, dtype=np.int64)
    d[valid] = np.fromiter(chain.from_iterable(drafts), dtype=np.int64, count=int(ks.sum()))
    mismatch = (np.asarray(sampled, dtype=np.int64)[rows] != d) | ~valid
    return np.where(mismatch.any(axis=1), mismatch.argmax(axis=1), ks)


def target_probs(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """The distribution the sampler draws from for each row: penalties, logit bias, temperature,
    top-k/top-p/min-p, softmax.

    Args:
        logits: ``[R, V]`` raw target logits (rows of non-greedy requests).
        rows: the matching :class:`VerifyRow` s.

    Returns:
        ``[R, V]`` float32 probabilities (truncated tokens exactly 0).
    """
    params = [r.sampling_params for r in rows]
    x = Sampler._apply_penalties(logits.float(), list(rows))
    x = Sampler._apply_logit_bias(x, params)
    x = torch.nan_to_num(x, nan=-1e30, posinf=1e30, neginf=-1e30)
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
    x = Sampler._truncate(x / temps.unsqueeze(1), params)
    return torch.softmax(x, dim=-1)


def salted_uniforms(sampler: Sampler, params: Sequence, indices: Sequence[int], salt: int) -> torch.Tensor:
    """One ``U[0, 1)`` per row, ``[R]`` float64: seeded rows hash ``(seed ^ salt, output index)``, others
    come from the sampler's shared generator."""
    u = torch.empty(len(params), dtype=torch.float64)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=sampler._shared_gen())
    for i, (p, k) in enumerate(zip(params, indices)):
        if p.seed is not None:
            u[i] = (_mix_seed(p.seed ^ salt, k) >> 10) * 2.0**-53
    return u


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                     u_resample: torch.Tensor, num_drafts: Sequence[int]) -> tuple[list[int], list[int | None]]:
    """Leviathan et al. §2.3 for drafts sampled from ``q``, batched over requests.

    Args:
        p: ``[R, V]`` target probabilities at the draft positions (request
            ``i`` owns ``num_drafts[i]`` consecutive rows; bonus rows excluded).
        q: ``[R, V]`` the draft distributions the drafts were sampled from.
        drafts: ``[R]`` int64 draft tokens.
        u_accept, u_resample: ``[R]`` uniforms in [0, 1).
        num_drafts: ``k_i`` per request (each >= 1).

    Returns:
        ``(num_accepted, replacement)`` per request: accepted drafts ``a_i``,
        and when ``a_i < k_i`` the token drawn from ``norm(max(0, p - q))`` at
        row ``a_i`` (None when every draft was accepted: the caller emits the
        bonus token sampled from the target).
    """
    dev = p.device
    d = drafts.to(dev).unsqueeze(1)
    pd = p.gather(1, d).squeeze(1).double()
    qd = q.gather(1, d).squeeze(1).double().clamp_min(1e-30)
    accept = (u_accept.to(dev) * qd < pd).cpu().numpy()          # u < p/q without dividing
    ks = np.asarray(num_drafts, dtype=np.int64)
    starts = np.cumsum(ks) - ks
    num_acc: list[int] = []
    reject_rows: list[int] = []
    for s, k in zip(starts.tolist(), ks.tolist()):
        rej = np.flatnonzero(~accept[s:s + k])
        a = int(rej[0]) if rej.size else k
        num_acc.append(a)
        if a < k:
            reject_rows.append(s + a)
    repl: list[int | None] = [None] * len(ks)
    if reject_rows:
        idx = torch.tensor(reject_rows, dtype=torch.int64, device=dev)
        resid = (p.index_select(0, idx) - q.index_select(0, idx)).clamp_min_(0)
        # p == q up to rounding leaves no mass: fall back to p (then acceptance was certain anyway).
        empty = resid.sum(dim=1, keepdim=True) <= 1e-12
        resid = torch.where(empty, p.index_select(0, idx), resid)
        toks = Sampler._inverse_cdf(resid, u_resample[torch.tensor(reject_rows)]).tolist()
        it = iter(toks)
        for i, (a, k) in enumerate(zip(num_acc, ks.tolist())):
            if a < k:
                repl[i] = int(next(it))
    return num_acc, repl
