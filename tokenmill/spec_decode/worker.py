"""The model runner's side of speculative decoding: verify this step's drafts, propose the next ones.

:class:`SpecDecodeWorker` is owned by :class:`~tokenmill.model.runner.ModelRunner`
when ``--speculative-config`` is set. Per step:

1. :meth:`SpecDecodeWorker.sample_and_verify` — the runner computed logits at
   every sampling request's last token and its drafts (``k + 1`` rows); each
   request keeps its accepted drafts plus one target token
   (:mod:`tokenmill.spec_decode.rejection_sampler`).
2. :meth:`SpecDecodeWorker.after_forward` — the draft model (``draft_model``)
   runs over the same flattened batch as the target, writing its own paged KV
   cache at the same slots (its pool has the target's block ids, so a block
   table and prefix-cache hit serve both models).
3. :meth:`SpecDecodeWorker.propose` — drafts for the next step:
   ``ngram`` looks up every request's context at once
   (:class:`~tokenmill.spec_decode.ngram.NgramProposer`); ``draft_model`` runs
   ``k`` single-token steps of the draft model, each batched over all
   requests.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.sampler import Sampler
from tokenmill.spec_decode.ngram import NgramProposer, TokenTable
from tokenmill.spec_decode.rejection_sampler import (
    ACCEPT_SALT, DRAFT_SALT, expand_rows, num_accepted_one_hot, rejection_sample, salted_uniforms, target_probs,
)

logger = logging.getLogger(__name__)


class SpecDecodeWorker:
    """Verification and proposal for one model runner.

    Args:
        spec: the speculative config; None for verification only: the drafts are grammar-forced tokens
            (structured outputs, :mod:`tokenmill.structured_output`), proposed by the engine core, and
            :meth:`propose` proposes none.
        config: the engine config (dtype, device, block size, max_model_len).
        runner: the target's model runner (its sampler, block size, KV pool size, vocabulary).

    Raises:
        ValueError: the draft model's vocabulary differs from the target's.
        FileNotFoundError: the draft checkpoint is missing.
    """

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, runner) -> None:
        self.spec = spec
        self.runner = runner
        self.sampler: Sampler = runner.sampler
        self.max_model_len = runner.max_model_len
        self.block_size = runner.block_size
        self.table = TokenTable(1024)
        method = spec.method if spec is not None else None
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if method == "ngram" else None
        self.draft = DraftModel(spec, config, runner) if method == "draft_model" else None

    # -- 1. verification ---------------------------------------------------------
    def sample_and_verify(self, logits: torch.Tensor, sampling: Sequence[ScheduledRequest]) -> ModelRunnerOutput:
        """Sample every row and keep each request's accepted prefix.

        Args:
            logits: ``[sum(k_i + 1), V]`` float32, the rows of each sampling
                request's last token and its ``k_i`` drafts, in batch order.
            sampling: the sampling requests.

        Returns:
            the step's :class:`ModelRunnerOutput` (``verified_*`` filled for
            requests that had drafts).
        """
        rows = expand_rows(sampling)
        tokens, lps = self.sampler(logits, rows)
        drafts = [r.spec_token_ids for r in sampling]
        ks = [len(d) for d in drafts]
        num_acc = num_accepted_one_hot(np.asarray(tokens, dtype=np.int64), drafts).tolist()
        starts = np.cumsum([k + 1 for k in ks]).tolist()
        starts = [s - k - 1 for s, k in zip(starts, ks)]
        emitted = [tokens[s:s + a + 1] for s, a in zip(starts, num_acc)]
        emitted_lps = [lps[s:s + a + 1] for s, a in zip(starts, num_acc)]
        if self.draft is not None:
            self._verify_sampled_drafts(logits, rows, tokens, sampling, starts, emitted, emitted_lps)
        out = ModelRunnerOutput(req_ids=[r.req_id for r in sampling], sampled_token_ids=[e[0] for e in emitted],
                                logprobs=[e[0] for e in emitted_lps])
        for r, k, e, elp in zip(sampling, ks, emitted, emitted_lps):
            if k:
                out.verified_token_ids[r.req_id] = e
                out.verified_logprobs[r.req_id] = elp
        return out

    def _verify_sampled_drafts(self, logits: torch.Tensor, rows: list, tokens: list[int],
                               sampling: Sequence[ScheduledRequest], starts: list[int],
                               emitted: list[list[int]], emitted_lps: list[list]) -> None:
        """Redo verification with the rejection rule for non-greedy requests whose drafts were sampled from ``q``.

        Updates ``emitted`` / ``emitted_lps`` in place for those requests.
        """
        assert self.draft is not None
        picks = [i for i, r in enumerate(sampling)
                 if r.spec_token_ids and not r.sampling_params.greedy
                 and self.draft.has_q(r.req_id, len(r.spec_token_ids))]
        if not picks:
            return
        ks = [len(sampling[i].spec_token_ids) for i in picks]
        row_idx = [starts[i] + j for i, k in zip(picks, ks) for j in range(k)]
        sel = [rows[x] for x in row_idx]
        p = target_probs(logits[torch.tensor(row_idx, device=logits.device)], sel)
        q = torch.cat([self.draft.pop_q(sampling[i].req_id)[:k] for i, k in zip(picks, ks)]).to(p.device)
        d = torch.tensor([t for i in picks for t in sampling[i].spec_token_ids], dtype=torch.int64)
        params = [x.sampling_params for x in sel]
        idx = [len(x.output_token_ids) for x in sel]
        u_acc = salted_uniforms(self.sampler, params, idx, ACCEPT_SALT)
        u_res = salted_uniforms(self.sampler, params, idx, 0)
        acc, repl = rejection_sample(p, q, d, u_acc, u_res, ks)
        for i, k, a, t in zip(picks, ks, acc, repl):
            s = starts[i]
            last = t if t is not None else tokens[s + k]   # all accepted: the target's sample at row k (bonus)
            toks = [*sampling[i].spec_token_ids[:a], int(last)]
            emitted[i] = toks
            emitted_lps[i] = self._logprobs_for(logits, rows, s, toks)

    def _logprobs_for(self, logits: torch.Tensor, rows: list, start: int, toks: list[int]) -> list:
        """The target's logprobs of ``toks`` at rows ``start ..``, reported as the sampler reports them
        (its ``logprobs_mode``); None entries when not asked for."""
        params = rows[start].sampling_params
        if params.logprobs is None:
            return [None] * len(toks)
        sel = list(rows[start:start + len(toks)])
        x = logits[start:start + len(toks)].float()
        mode = self.sampler.logprobs_mode
        if not mode.startswith("raw"):
            x = Sampler._apply_logit_bias(Sampler._apply_penalties(x, sel), [params] * len(sel))
        source = x      # grammar-masked (and -inf-biased) tokens stay -inf in the report, as the sampler's
        x = torch.nan_to_num(x, nan=-1e30, posinf=1e30, neginf=-1e30)
        if not mode.startswith("raw") and not params.greedy:
            x = Sampler._truncate(x / params.temperature, [params] * len(sel))
        x = Sampler.keep_neg_inf(x, source)
        return Sampler._logprobs(x, torch.tensor(toks, device=x.device), [params.logprobs] * len(toks),
                                 mode.endswith("logprobs"))

    # -- 2. draft model over the step's tokens -----------------------------------------
    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """Run the draft model over the target's flattened batch (``draft_model`` only), filling its KV cache."""
        if self.draft is not None:
            self.draft.forward(input_ids, positions, md)

    def forget(self, req_ids) -> None:
        """Drop the state of finished requests (their token rows and draft distributions)."""
        for rid in req_ids:
            self.table.remove(rid)
            if self.draft is not None:
                self.draft.forget(rid)

    # -- 3. proposals ----------------------------------------------------------------------
    def propose(self, so: SchedulerOutput, sampling: Sequence[ScheduledRequest],
                emitted: Sequence[Sequence[int]]) -> dict[str, list[int]]:
        """Drafts for each sampling request's next step (``so.num_spec_tokens`` at most; none when 0).

        Args:
            so: this step's scheduler output (``finished_req_ids`` are forgotten here).
            sampling: the requests that sampled this step.
            emitted: per request, the tokens this step emits (accepted drafts + target token).

        Returns:
            req id -> draft token ids (requests with no draft are left out).
        """
        self.forget(so.finished_req_ids)
        k = so.num_spec_tokens
        if k <= 0 or not sampling or (self.ngram is None and self.draft is None):
            return {}
        if self.ngram is not None:
            rows = [self.table.sync(r.req_id, r.prompt_token_ids, r.output_token_ids, e, reset=r.new)
                    for r, e in zip(sampling, emitted)]
            drafts = self.ngram.propose(self.table.tokens[rows], self.table.lengths[rows], k)
        else:
            assert self.draft is not None
            drafts = self.draft.propose(sampling, emitted, k)
        return {r.req_id: d for r, d in zip(sampling, drafts) if d}


class DraftModel:
    """A small checkpoint that shares the target's tokenizer, with its own paged KV cache.

    The draft's pool has as many blocks as the target's (``num_kv_blocks + 1``,
    the last one the scratch block) and is indexed by the same block tables,
    so it needs no allocator of its own: whatever the target has computed,
    the draft has computed too (both run over every step's tokens), prefix-cache
    hits included. Drafts it writes past the target's computed tokens land in
    the request's lookahead slots (the scheduler reserves
    ``num_speculative_tokens`` of them) and are overwritten later.

    Args:
        spec: the speculative config (``model``: the draft checkpoint).
        config: engine config (dtype, device).
        runner: the target's runner (KV pool geometry, vocabulary, sampler).

    Raises:
        ValueError: the vocabularies differ.
    """

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, runner) -> None:
        from tokenmill.model.layers.linear import (attach_lowbit_weights, int8_act_max_tokens, lowbit_max_tokens,
                                                   pack_linear_weights)
        from tokenmill.model.loader import load_model

        # A GGUF draft keeps its low-bit codes for small steps, as the target does (its k proposal steps are
        # steps of one token per request: dense bfloat16 weights would make each cost more than the target's).
        switches = config.cpu_kernels
        limit = lowbit_max_tokens(runner.device, runner.dtype, switches) if config.model.enforce_eager else 0
        loaded = load_model(spec.model, dtype=runner.dtype, device=runner.device, with_tokenizer=False,
                            lowbit=limit > 0, cpu_kernels=switches)
        if loaded.arch.vocab_size != runner.arch.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({loaded.arch.vocab_size} tokens) "
                             f"differs from the target's ({runner.arch.vocab_size}); it must share the tokenizer")
        self.model = loaded.model
        self.arch = loaded.arch
        pack_linear_weights(self.model)
        self.lowbit_layers = 0
        if limit and loaded.lowbit_weights:
            self.lowbit_layers = attach_lowbit_weights(self.model, loaded.lowbit_weights, limit,
                                                       int8_act_max_tokens(limit, switches))[0]
        loaded.lowbit_weights = None
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.sampler: Sampler = runner.sampler
        shape = (2, runner.num_kv_blocks + 1, self.block_size, self.arch.num_key_value_heads, self.arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=runner.dtype, device=self.device)
                          for _ in range(self.arch.num_hidden_layers)]
        self._q: dict[str, torch.Tensor] = {}
        logger.info("draft model %s: %d layers, KV pool %d blocks (%.1f MiB), %s", loaded.name,
                    self.arch.num_hidden_layers, runner.num_kv_blocks + 1,
                    sum(t.numel() * t.element_size() for t in self.kv_caches) / 2**20,
                    f"low-bit codes in {self.lowbit_layers} linears for steps <= {limit} tokens"
                    if self.lowbit_layers else "dense weights")

    def has_q(self, req_id: str, k: int) -> bool:
        q = self._q.get(req_id)
        return q is not None and q.shape[0] >= k

    def pop_q(self, req_id: str) -> torch.Tensor:
        return self._q.pop(req_id)

    def forget(self, req_id: str) -> None:
        self._q.pop(req_id, None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """The draft over the target's batch (same tokens, positions and slots; its own cache)."""
        self.model(input_ids, positions, self.kv_caches, dataclasses.replace(md, cache={}))

    @torch.inference_mode()
    def propose(self, sampling: Sequence[ScheduledRequest], emitted: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """``k`` draft tokens per request from ``k`` single-token draft steps, each batched over the requests.

        Greedy requests take the draft's argmax; the others sample from
        ``q = softmax(truncate(logits / T))`` (a seeded request with a uniform
        hashed from its seed and the output index) and keep ``q`` for the
        rejection rule. A request gets fewer drafts when its KV slots, its
        ``max_tokens`` or the context would run out.

        Returns:
            per request, its drafts.
        """
        B = len(sampling)
        bs = self.block_size
        out: list[list[int]] = [[] for _ in range(B)]
        # position of the token each request continues from (the one this step emitted last)
        pos0 = np.array([r.num_computed_tokens + len(r.token_ids) - len(r.spec_token_ids) + len(e) - 1
                         for r, e in zip(sampling, emitted)], dtype=np.int64)
        cap = np.array([len(r.block_ids) * bs for r in sampling], dtype=np.int64)
        n_out = np.array([len(r.output_token_ids) + len(e) for r, e in zip(sampling, emitted)], dtype=np.int64)
        left = np.array([self.max_model_len if r.sampling_params.max_tokens is None else r.sampling_params.max_tokens
                         for r in sampling], dtype=np.int64) - n_out - 1
        kk = np.minimum.reduce([np.full(B, k), cap - pos0, left, self.max_model_len - 1 - pos0 - 1])
        kk = np.maximum(kk, 0)
        kmax = int(kk.max()) if B else 0
        if kmax == 0:
            return out
        width = max(len(r.block_ids) for r in sampling)
        table = np.zeros((B, width), dtype=np.int32)
        for i, r in enumerate(sampling):
            table[i, :len(r.block_ids)] = r.block_ids
        table_t = torch.from_numpy(table).to(self.device)
        cur = np.array([e[-1] for e in emitted], dtype=np.int64)
        greedy = np.array([r.sampling_params.greedy for r in sampling])
        qs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        for j in range(kmax):
            act = np.flatnonzero(kk > j)
            pos = pos0[act] + j
            slots = table[act, pos // bs].astype(np.int64) * bs + pos % bs
            n = len(act)
            md = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(self.device),
                query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.from_numpy((pos + 1).astype(np.int32)).to(self.device),
                block_tables=table_t[torch.from_numpy(act).to(self.device)],
                query_lens=[1] * n, seq_lens_list=(pos + 1).tolist(), max_query_len=1,
                max_seq_len=int(pos.max()) + 1, block_size=bs)
            hidden = self.model(torch.from_numpy(cur[act]).to(self.device), torch.from_numpy(pos).to(self.device),
                                self.kv_caches, md)
            logits = self.model.compute_logits(hidden).float()
            nxt = logits.argmax(dim=-1).cpu().numpy()
            samp = np.flatnonzero(~greedy[act])
            if samp.size:
                sub_reqs = [sampling[int(act[s])] for s in samp]
                params = [r.sampling_params for r in sub_reqs]
                x = logits[torch.from_numpy(samp).to(logits.device)]
                temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
                q = torch.softmax(Sampler._truncate(x / temps.unsqueeze(1), params), dim=-1)
                u = draft_uniforms(self.sampler, params, (n_out[act[samp]] + j).tolist())
                picked = Sampler._inverse_cdf(q, u).cpu().numpy()
                nxt[samp] = picked
                for s, row in zip(samp.tolist(), q):
                    qs[int(act[s])].append(row)
            for a, t in zip(act.tolist(), nxt.tolist()):
                out[a].append(int(t))
            cur[act] = nxt
        for i, r in enumerate(sampling):
            if qs[i]:
                self._q[r.req_id] = torch.stack(qs[i])
            else:
                self._q.pop(r.req_id, None)
        return out


def draft_uniforms(sampler: Sampler, params: Sequence, indices: Sequence[int]) -> torch.Tensor:
    """Uniforms for sampling drafts: seeded rows hash ``(seed ^ DRAFT_SALT, output index)``."""
    return salted_uniforms(sampler, params, indices, DRAFT_SALT)
