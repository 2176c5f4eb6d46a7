"""Batched next-token sampling: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

The sampler turns one row of logits per sampling request into one token id per
request. Every transformation is a tensor op over the whole batch (or over the
sub-batch that needs it); Python only walks the requests to collect their
parameters and token lists. Features no request in the batch uses are skipped.

Order of operations for row ``i`` (the order Hugging Face ``generate`` and vLLM
use):

1. repetition penalty on tokens of prompt + output (CTRL, Keskar et al. 2019,
   §4.1): positive logits divided by the penalty, negative ones multiplied;
2. frequency and presence penalties on tokens of the output (OpenAI API
   semantics): ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``;
3. greedy rows (temperature 0) take the argmax here;
4. the other rows are divided by their temperature, then truncated by top-k,
   top-p (nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751) and min-p
   (Nguyen et al. 2024, arXiv 2407.01082), and sampled.

Sampling is inverse-transform sampling: one uniform ``u`` per row and the
first token whose cumulative probability exceeds ``u``. For a seeded request,
``u`` for its k-th output token is a hash of ``(seed, k)`` only (SplitMix64),
so that token depends neither on the rest of the batch, nor on the device's
RNG, nor on whether the request was preempted and recomputed. Unseeded rows
draw ``u`` from one engine-level CPU generator. (An exponential race,
``argmax p / Exp(1)``, would need ``V`` random numbers per row: measured on 2
CPU cores at ``[32, 49152]`` it took 17.5 ms against 1.0 ms for this.)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tokenmill.core.sched_output import ScheduledRequest
from tokenmill.model.layers import fused_cpu
from tokenmill.outputs import TokenLogprobs

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, k: int) -> int:
    """Mix a request seed and an output index into one 63-bit integer.

    SplitMix64 finaliser (Steele et al., "Fast splittable pseudorandom number
    generators", OOPSLA 2014) applied to ``seed`` and then to the result xor
    ``k``, so nearby ``(seed, k)`` pairs give unrelated values.
    """

    def _splitmix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)

    return _splitmix(_splitmix(seed & _MASK64) ^ (k & _MASK64)) & ((1 << 63) - 1)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad ragged int lists with ``pad`` -> ``[len(rows), max_len]`` int64 on ``device``."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device, non_blocking=True)


class Sampler:
    """Sample one token per request from a batch of logits.

    Args:
        seed: seed of the engine-level generator shared by requests without
            their own ``SamplingParams.seed``; None seeds it from the OS.
        device: informational; logits may live on any device. Random numbers
            (one per sampled row) are always drawn on the CPU, so seeded
            results are the same on every device up to floating-point
            differences in softmax/cumsum.

    Call with ``logits`` ``[num_reqs, vocab]`` (float32, any device; row ``i``
    belongs to ``reqs[i]``). Returns ``(token_ids, logprobs)``: ``num_reqs``
    Python ints, and per request a :class:`TokenLogprobs` when
    ``sampling_params.logprobs`` is not None, else None.

    What the logprobs report follows ``logprobs_mode`` (vLLM's
    ``--logprobs-mode``): ``raw_logprobs`` (default) is ``log_softmax`` of the
    model's logits before penalties, temperature and top-k/top-p/min-p, so
    the values do not depend on the sampling parameters; ``raw_logits`` the
    logits themselves; ``processed_logprobs`` / ``processed_logits`` the
    distribution actually sampled from (penalties, then temperature and
    truncation for non-greedy rows; truncated tokens are ``-inf``). Every mode
    sees the logits after the structured-outputs grammar mask (the runner
    applies it before calling the sampler, as vLLM's): refused tokens report
    ``-inf``. The rank is the sampled token's 1-based rank in the reported values.

    Raises:
        ValueError: when ``logits`` is not 2-D or its row count differs from
            ``len(reqs)``.
    """

    LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None,
                 logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in self.LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(self.LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self._seed = seed
        self._generator: torch.Generator | None = None
        self.device = None if device is None else torch.device(device)

    def _shared_gen(self) -> torch.Generator:
        """The engine-level CPU generator for unseeded requests (created on first use)."""
        if self._generator is None:
            gen = torch.Generator()
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generator = gen
        return self._generator

    # -- main entry ---------------------------------------------------------
    def __call__(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest], deferred: Any = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample one token per row.

        Args:
            logits: ``[num_reqs, vocab]`` float (float32 preferred; other
                dtypes are upcast), one row per sampling request in the order
                of ``reqs``; not modified (except where ``deferred``'s mask is
                written into it).
            reqs: the sampling requests (``sample`` set), giving
                ``sampling_params``, ``prompt_token_ids`` and ``output_token_ids``.
            deferred: the structured-outputs mask of some rows, not yet written
                into ``logits`` (a :class:`~tokenmill.structured_output.xgrammar_backend.SparseRowsMask`:
                ``rows``, ``argmax(logits)``, ``write(logits)``; float32 CPU
                logits). On the all-greedy path without logprobs such a row's
                token is the argmax over its allowed ids (the first maximum, as
                ``argmax`` of the masked row); otherwise the mask is written
                first. Either way the tokens are those of the masked logits.
        Returns:
            ``(token_ids, logprobs)``, each of length ``num_reqs``.
        Raises:
            ValueError: shape mismatch.
        """
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(
                f"logits must be [num_reqs={len(reqs)}, vocab], got {tuple(logits.shape)}"
            )
        if not reqs:
            return [], []
        params = [r.sampling_params for r in reqs]
        logits = logits.float()
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        if deferred is not None and (want_lp or not all(p.greedy for p in params)):
            deferred.write(logits)      # the full masked rows are needed (logprobs, sampling)
            deferred = None
        raw_mode = self.logprobs_mode.startswith("raw")
        # raw modes report the model's own distribution, before any sampling parameter touches it
        lp_logits = self.keep_neg_inf(torch.nan_to_num(logits[want_lp], nan=-1e30, posinf=1e30, neginf=-1e30),
                                      logits[want_lp]) if want_lp and raw_mode else None
        logits = self._apply_penalties(logits, reqs)
        logits = self._apply_logit_bias(logits, params)
        before_nan = logits     # the penalised rows with their -inf entries (processed modes report those -inf)
        if not want_lp and all(p.greedy for p in params):
            # all-greedy fast path: argmax of the raw rows, one pass instead of nan_to_num's copy + argmax.
            # Equal to the path below whenever every row's maximum is finite and above -1e30: argmax returns a
            # NaN's or +inf's index if the row has one (then the check fails), and nan_to_num only raises -inf
            # to -1e30, below such a maximum. Rows failing the check take the full path.
            if deferred is not None:
                ids = self._argmax_deferred(logits, deferred)
                if ids is not None:
                    return ids, [None] * len(reqs)
                deferred.write(logits)      # a row's best allowed logit is not finite: the full path decides
                deferred = None
            token_ids, best = self._argmax_rows(logits)
            if best.device.type == "cpu":     # numpy: one call instead of five torch ops on [B] (~20 us at B=1)
                b = best.numpy()
                ok = bool(np.isfinite(b).all() and (b > -1e30).all())
            else:
                ok = bool((torch.isfinite(best) & (best > -1e30)).all())
            if ok:
                return token_ids.tolist(), [None] * len(reqs)
        # Extreme penalties or a numerically broken model can give inf/NaN logits: keep every row a valid
        # distribution so a bad request can never produce an out-of-vocabulary id.
        # (1e30 stays finite after division by any allowed temperature, >= 1e-5.)
        logits = torch.nan_to_num(logits, nan=-1e30, posinf=1e30, neginf=-1e30)

        device = logits.device
        greedy = [p.greedy for p in params]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]

        # processed modes: the rows actually sampled from (greedy rows: the penalised logits)
        processed = logits.clone() if want_lp and not raw_mode else None

        if not sampled_rows:
            token_ids = self._argmax_rows(logits)[0]
        else:
            all_sampled = len(sampled_rows) == len(reqs)
            sub_params = params if all_sampled else [params[i] for i in sampled_rows]
            sub_reqs = reqs if all_sampled else [reqs[i] for i in sampled_rows]
            idx = torch.tensor(sampled_rows, dtype=torch.int64).to(device, non_blocking=True)
            sub = logits if all_sampled else logits[idx]
            if any(p.temperature != 1.0 for p in sub_params):
                temps = torch.tensor([p.temperature for p in sub_params], dtype=sub.dtype)
                sub = sub / temps.to(device, non_blocking=True).unsqueeze(1)
            sub = self._truncate(sub, sub_params)
            if processed is not None:
                processed[idx] = sub
            choice = self._inverse_cdf(torch.softmax(sub, dim=-1), self._uniforms(sub_reqs))
            if all_sampled:
                token_ids = choice
            else:
                token_ids = self._argmax_rows(logits)[0]
                token_ids[idx] = choice

        ids = token_ids.clamp_(0, logits.shape[1] - 1).tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(reqs)
        if want_lp:
            if processed is not None:
                lp_logits = self.keep_neg_inf(processed[want_lp], before_nan[want_lp])
            assert lp_logits is not None
            normalize = self.logprobs_mode.endswith("logprobs")
            nums = [params[i].logprobs for i in want_lp]
            for i, tlp in zip(want_lp, self._logprobs(lp_logits, token_ids[want_lp], nums, normalize)):
                out_lp[i] = tlp
        return ids, out_lp

    @staticmethod
    def keep_neg_inf(values: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``values`` ``[R, V]`` with ``-inf`` wherever ``source`` ``[R, V]`` is ``-inf``: the reported value of
        a token the grammar mask (or a ``-inf`` logit bias) refused, as vLLM reports it, instead of the
        finite ``-1e30`` that ``nan_to_num`` put there so sampling stays defined. Rows of ``source``
        with no entry above ``-inf`` are left finite (``log_softmax`` of them would be NaN)."""
        neg = torch.isneginf(source)
        if not bool(neg.any()):
            return values
        neg &= ~neg.all(dim=1, keepdim=True)
        return values.masked_fill(neg, float("-inf"))

    # -- steps ----------------------------------------------------------------
    @staticmethod
    def _argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits.argmax(dim=-1)`` of ``[B, V]`` logits and the values there (``[B]`` int64, ``[B]``):
        the first maximum of each row (ties: the lowest id), a NaN's index where the row holds one.
        Float32 CPU rows take one C pass per row (:func:`~tokenmill.model.layers.fused_cpu.argmax_rows`,
        the same ids and values bit for bit; 64 x 49152 logits: ~1 ms instead of 4 on 2 AVX2 cores);
        other tensors the torch ops."""
        fast = fused_cpu.argmax_rows(logits)
        if fast is not None:
            return fast
        ids = logits.argmax(dim=-1)
        return ids, logits.gather(1, ids.unsqueeze(1)).squeeze(1)

    @staticmethod
    def _argmax_deferred(logits: torch.Tensor, deferred: Any) -> list[int] | None:
        """The all-greedy fast path's tokens with ``deferred``'s rows unmasked in ``logits`` (``[B, V]``
        float32 CPU, after penalties and bias): the argmax over each deferred row's allowed ids, and the
        plain argmax of the other rows (one pass over each run of them, no copy). None when a row's best
        logit fails the fast path's check (finite, above -1e30): the caller writes the mask and takes the
        full path."""
        out = np.empty(logits.shape[0], dtype=np.int64)
        best = np.empty(logits.shape[0], dtype=np.float32)
        rows = deferred.rows
        out[rows], best[rows] = deferred.argmax(logits)
        start = 0
        for a, b, _ in deferred.runs + [(logits.shape[0], logits.shape[0], 0)]:
            if a > start:       # rows start .. a-1 are not deferred
                t, v = Sampler._argmax_rows(logits[start:a])
                out[start:a] = t.numpy()
                best[start:a] = v.numpy()
            start = b
        if not bool((np.isfinite(best) & (best > -1e30)).all()):
            return None
        return out.tolist()

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """Repetition, frequency and presence penalties, batched.

        ``logits`` ``[B, V]`` -> new ``[B, V]`` tensor (input untouched). Token
        lists are right-padded with the id ``V`` and scattered into ``[B, V + 1]``
        tensors whose last column is dropped.
        """
        params = [r.sampling_params for r in reqs]
        need_rep = any(p.repetition_penalty != 1.0 for p in params)
        need_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        if not (need_rep or need_freq):
            return logits
        batch, vocab = logits.shape
        device = logits.device
        if need_rep:
            rows = [
                (list(r.prompt_token_ids) + list(r.output_token_ids)) if r.sampling_params.repetition_penalty != 1.0 else []
                for r in reqs
            ]
            toks = _padded(rows, vocab, device)
            seen = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=device)
            seen.scatter_(1, toks, True)
            seen = seen[:, :vocab]
            pen = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)
            pen = pen.to(device, non_blocking=True).unsqueeze(1)
            penalised = torch.where(logits > 0, logits / pen, logits * pen)
            logits = torch.where(seen, penalised, logits)
        if need_freq:
            rows = [
                list(r.output_token_ids)
                if (r.sampling_params.frequency_penalty != 0.0 or r.sampling_params.presence_penalty != 0.0)
                else []
                for r in reqs
            ]
            toks = _padded(rows, vocab, device)
            counts = torch.zeros((batch, vocab + 1), dtype=logits.dtype, device=device)
            counts.scatter_add_(1, toks, torch.ones_like(toks, dtype=logits.dtype))
            counts = counts[:, :vocab]
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)
            freq = freq.to(device, non_blocking=True).unsqueeze(1)
            pres = pres.to(device, non_blocking=True).unsqueeze(1)
            logits = logits - counts * freq - (counts > 0).to(logits.dtype) * pres
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Add each request's ``logit_bias`` (token id -> bias) to its row; ``[B, V]`` -> new ``[B, V]``.

        Ids at or beyond the vocabulary are ignored here (the server refuses them with 400).
        """
        rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if not rows:
            return logits
        vocab = logits.shape[1]
        r_idx, t_idx, vals = [], [], []
        for i, bias in rows:
            for t, b in bias.items():
                if 0 <= t < vocab:
                    r_idx.append(i)
                    t_idx.append(t)
                    vals.append(float(b))
        if not vals:
            return logits
        logits = logits.clone()
        device = logits.device
        logits.index_put_((torch.tensor(r_idx, device=device), torch.tensor(t_idx, device=device)),
                          torch.tensor(vals, dtype=logits.dtype, device=device), accumulate=True)
        return logits

    # Top-p first looks for the nucleus among this many best tokens and falls
    # back to a full sort only when a row's nucleus is larger (a full sort of
    # [32, 49152] costs ~60 ms on 2 CPU cores, topk(1024) ~8 ms).
    TOP_P_CANDIDATES = 1024

    @classmethod
    def _truncate(cls, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Top-k, then top-p, then min-p; dropped tokens get ``-inf``.

        ``logits`` ``[B, V]`` (already temperature-scaled) -> ``[B, V]``; the
        input is not modified. The most likely token always survives; tokens
        tied with the last kept one are kept too. Top-p keeps the smallest set
        of most likely tokens whose probability (after top-k) reaches ``top_p``.
        """
        batch, vocab = logits.shape
        device = logits.device
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        need_k = any(k < vocab for k in top_k)
        need_p = any(p.top_p < 1.0 for p in params)
        need_min_p = any(p.min_p > 0.0 for p in params)
        if need_p:
            thresh = cls._top_k_top_p_threshold(logits, params, top_k)
            logits = logits.masked_fill(logits < thresh, float("-inf"))
        elif need_k:
            kmax = max(top_k)
            top_vals = logits.topk(kmax, dim=-1).values  # [B, kmax], descending
            k = torch.tensor([k - 1 for k in top_k], dtype=torch.int64).to(device, non_blocking=True)
            thresh = top_vals.gather(1, k.unsqueeze(1))
            logits = logits.masked_fill(logits < thresh, float("-inf"))
        if need_min_p:
            # p_j < min_p * p_max  <=>  logit_j < max_logit + log(min_p)
            log_min_p = torch.tensor(
                [math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params], dtype=logits.dtype
            ).to(device, non_blocking=True)
            thresh = logits.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1)
            logits = logits.masked_fill(logits < thresh, float("-inf"))
        return logits

    @classmethod
    def _top_k_top_p_threshold(cls, logits: torch.Tensor, params: list, top_k: list[int]) -> torch.Tensor:
        """Per-row smallest logit kept by top-k + top-p, ``[B, 1]`` (``-inf``: keep all).

        Works on the ``K`` best logits (``K`` = max(finite top_k, TOP_P_CANDIDATES));
        rows without top-k are normalised over the whole vocabulary. When some
        row's nucleus does not fit in ``K`` tokens, it redoes the batch with
        ``K = vocab`` (a full sort).
        """
        batch, vocab = logits.shape
        device = logits.device
        finite_k = [k for k in top_k if k < vocab]
        cand = min(vocab, max(max(finite_k, default=0), cls.TOP_P_CANDIDATES))
        k = torch.tensor(top_k, dtype=torch.int64).to(device, non_blocking=True).unsqueeze(1)
        # Rows with top_p == 1 get a bound that no rounded cumulative sum reaches.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], dtype=logits.dtype)
        top_p = top_p.to(device, non_blocking=True).unsqueeze(1)
        while True:
            vals = logits.topk(cand, dim=-1).values if cand < vocab else logits.sort(dim=-1, descending=True).values
            ranks = torch.arange(cand, device=device).unsqueeze(0)
            vals = vals.masked_fill(ranks >= k, float("-inf"))  # top-k in sorted order
            # Normaliser of the top-k distribution: within the candidates when
            # the row's k fits there, else over the whole row.
            lse = vals.logsumexp(dim=-1, keepdim=True)
            if cand < vocab and any(kk > cand for kk in top_k):
                lse = torch.where(k > cand, logits.logsumexp(dim=-1, keepdim=True), lse)
            probs = (vals - lse).exp()
            cum = probs.cumsum(dim=-1)
            drop = (cum - probs) >= top_p
            drop[:, 0] = False
            if cand < vocab:
                # A row whose nucleus (or top-k set) may extend past the candidates.
                open_rows = (~drop[:, -1:]) & (k > cand) & (top_p <= 1.0)
                if bool(open_rows.any()):
                    cand = vocab
                    continue
            kept = (~drop & torch.isfinite(vals)).sum(dim=-1, keepdim=True)  # >= 1
            thresh = vals.gather(1, kept - 1)
            no_cut = (k >= vocab) & (top_p > 1.0)
            return thresh.masked_fill(no_cut, float("-inf"))

    def _uniforms(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """One ``U[0, 1)`` draw per request, ``[B]`` float64 on the CPU.

        A seeded request's draw for its k-th output token (``k =
        len(output_token_ids)``) is ``_mix_seed(seed, k)`` scaled to 53 bits,
        so it depends on nothing else (not the batch, not the device, not
        preemption). The others come, in batch order, from the shared generator.
        """
        u = torch.empty(len(reqs), dtype=torch.float64)
        unseeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), dtype=torch.float64, generator=self._shared_gen())
            if len(unseeded) == len(reqs):
                return draws
            u[unseeded] = draws
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None:
                u[i] = (_mix_seed(r.sampling_params.seed, len(r.output_token_ids)) >> 10) * 2.0**-53
        return u

    @staticmethod
    def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Inverse-transform sampling: row ``i`` picks the first token whose
        cumulative probability exceeds ``u[i]`` × the row's total.

        Args:
            probs: ``[B, V]`` non-negative (masked tokens exactly 0).
            u: ``[B]`` uniforms in ``[0, 1)`` (any device, any float dtype).
        Returns:
            ``[B]`` int64 token ids; a zero-probability token is never chosen.
        """
        cdf = probs.cumsum(dim=-1)  # CPU accumulates float32 cumsums in double
        total = cdf[:, -1:]
        target = u.to(device=probs.device, dtype=probs.dtype).unsqueeze(1) * total
        # Stay strictly below the total so the search never runs past the last
        # token with non-zero probability.
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    @classmethod
    def token_logprobs(cls, logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
        """Log-probabilities of given ``tokens`` ``[R]`` under raw ``logits`` ``[R, V]`` (e.g. prompt
        logprobs), with ``num_top`` (0..20) top alternatives each; non-finite logits are sanitised
        as in sampling."""
        logits = torch.nan_to_num(logits, nan=-1e30, posinf=1e30, neginf=-1e30)
        return cls._logprobs(logits, tokens, [num_top] * int(tokens.shape[0])) if tokens.numel() else []

    @staticmethod
    def _top_entries(lp: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """The ``k`` largest values of each row of ``lp`` ``[R, V]`` and their ids, ties broken by the
        smaller id. ``topk``'s order among equal values (common with a bfloat16 model's logits) depends on
        the row count and layout of the call, i.e. on the batch: the tied entries are re-ranked here so a
        request's ``top_logprobs`` never depend on its neighbours (batch invariance)."""
        vals, ids = lp.topk(k, dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        last = vals[:, -1:]
        # rows where the k-th value is tied with another entry (inside or outside the top k)
        tied = ((lp == last).sum(dim=-1) > 1) | (vals[:, :-1] == vals[:, 1:]).any(dim=-1) if k > 1 else \
            (lp == last).sum(dim=-1) > 1
        for r in tied.nonzero().flatten().tolist():
            cand = (lp[r] >= last[r]).nonzero().flatten()            # ascending ids
            order = torch.sort(lp[r, cand], descending=True, stable=True).indices[:k]
            ids_l[r] = cand[order].tolist()
            vals_l[r] = lp[r, ids_l[r]].tolist()
        return vals_l, ids_l

    @staticmethod
    def _logprobs(logits: torch.Tensor, chosen: torch.Tensor, nums: list[int],
                  normalize: bool = True) -> list[TokenLogprobs]:
        """Log-probabilities (or logits) for rows that asked.

        Args:
            logits: ``[R, V]`` the distribution to report.
            chosen: ``[R]`` sampled ids.
            nums: per row, how many top entries to return (0..20).
            normalize: report ``log_softmax(logits)``; False reports the logits as they are.
        Returns:
            ``R`` :class:`TokenLogprobs`; ``rank`` is 1 + the number of tokens
            with a strictly larger value.
        """
        lp = torch.log_softmax(logits, dim=-1) if normalize else logits
        chosen_lp = lp.gather(1, chosen.unsqueeze(1))  # [R, 1]
        ranks = (lp > chosen_lp).sum(dim=-1) + 1
        n_max = max(nums)
        if n_max > 0:
            top_lp_l, top_ids_l = Sampler._top_entries(lp, min(n_max, lp.shape[1]))
        else:
            top_lp_l = top_ids_l = [[] for _ in nums]
        chosen_l, ranks_l = chosen_lp.squeeze(1).tolist(), ranks.tolist()
        return [
            TokenLogprobs(
                logprob=chosen_l[r],
                rank=int(ranks_l[r]),
                top_token_ids=top_ids_l[r][: nums[r]],
                top_logprobs=top_lp_l[r][: nums[r]],
            )
            for r in range(len(nums))
        ]
