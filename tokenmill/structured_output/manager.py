"""The engine core's structured-output state: compiles off the loop, one matcher per request, the step's bitmask.

:class:`StructuredOutputManager` is owned by the engine core and handed to the
scheduler (duck-typed: :mod:`tokenmill.core` imports none of this). Its life cycle
per constrained request:

1. :meth:`~StructuredOutputManager.add_request` — the constraint is looked up in the
   compile cache (key: :func:`~tokenmill.structured_output.backend.constraint_key`, one
   backend per tokenizer) or submitted to a thread pool; the request waits in the
   scheduler (``WAITING_FOR_FSM``) and other requests keep running.
2. :meth:`~StructuredOutputManager.poll` — each schedule: compiled → a matcher, the
   request joins the waiting queue; failed or past ``compile_timeout_s`` → the
   request fails with HTTP 400 and the backend's message.
3. :meth:`~StructuredOutputManager.grammar_bitmask` — after scheduling, one bitmask
   row per logits row of every constrained sampling request (its last token and each
   draft: the matcher is advanced through the drafts and rolled back), filled on a
   worker thread while the forward runs (started by the runner as the forward starts);
   the runner waits for it only when it has logits to mask.
4. :meth:`~StructuredOutputManager.accept` — the step's emitted tokens advance the matcher.
5. :meth:`~StructuredOutputManager.drafts` — the next step's drafts: the tokens the
   grammar forces (free drafts, verified in the same forward through the
   speculative-decoding path), else the proposer's drafts cut to their longest
   grammar-valid prefix.

A matcher is tied to the request's output tokens, which survive preemption by
recompute; if the two ever disagree (:meth:`_sync`), the matcher is rebuilt from the
request's output tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import (
    GrammarMatcher, StructuredOutputBackend, StructuredOutputError, constraint_key,
)

logger = logging.getLogger(__name__)

# Compile times kept for the metrics exporter between two snapshots (it observes the new ones).
MAX_RECENT_COMPILE_TIMES = 256


@dataclass
class StructuredOutputStats:
    """Cumulative structured-output counters of one engine core (plain data, sent with the engine stats).

    Attributes:
        requests_by_kind: constrained requests seen, by constraint kind (json, regex, choice, ...).
        compile_count, compile_time_sum: compiles run and their seconds; ``recent_compile_times`` the
            last :data:`MAX_RECENT_COMPILE_TIMES` of them (seconds, oldest first) for the histogram.
        num_waiting_for_grammar: requests waiting for their grammar now (set in each snapshot).
        cache_queries, cache_hits: compile-cache lookups, and those served without compiling.
        compile_failures: constraints the backend refused (the requests failed with 400).
        compile_timeouts: requests failed because their grammar took longer than ``compile_timeout_s``.
        mask_steps: steps that filled a bitmask; ``mask_fill_time`` their fill seconds (on the worker
            thread); ``mask_wait_time`` the seconds the model runner waited for it (the critical path);
            ``mask_rows`` rows filled.
        forced_draft_tokens, forced_accepted_tokens: grammar-forced tokens verified as drafts, and of those
            the ones the model's own sample agreed with (the rest differ only in tokenization).
    """

    requests_by_kind: dict[str, int] = field(default_factory=dict)
    compile_count: int = 0
    compile_time_sum: float = 0.0
    recent_compile_times: list[float] = field(default_factory=list)
    num_waiting_for_grammar: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    compile_failures: int = 0
    compile_timeouts: int = 0
    mask_steps: int = 0
    mask_fill_time: float = 0.0
    mask_wait_time: float = 0.0
    mask_rows: int = 0
    forced_draft_tokens: int = 0
    forced_accepted_tokens: int = 0

    def observe_compile(self, seconds: float) -> None:
        self.recent_compile_times = self.recent_compile_times[-(MAX_RECENT_COMPILE_TIMES - 1):] + [seconds]
        self.compile_time_sum += seconds
        self.compile_count += 1

    def copy(self) -> "StructuredOutputStats":
        import copy

        return copy.deepcopy(self)


class _RequestState:
    """One constrained request: its compile future, then its matcher."""

    __slots__ = ("req_id", "future", "key", "matcher", "num_accepted", "trace")

    def __init__(self, req_id: str, future: Future, key: tuple) -> None:
        self.req_id = req_id
        self.future = future
        self.key = key
        self.matcher: GrammarMatcher | None = None
        self.num_accepted = 0       # output tokens the matcher has accepted
        self.trace: _Trace | None = None    # the forced string being written, and the model's tokens so far


class _Trace:
    """A forced string the request is writing: ``text`` (bytes), ``pos`` bytes of it written by ``tokens``."""

    __slots__ = ("text", "pos", "tokens")

    def __init__(self, text: bytes) -> None:
        self.text = text
        self.pos = 0
        self.tokens: list[int] = []


class GrammarBitmask:
    """The bitmask of one step, being filled on the manager's worker thread.

    The bitmask has one row per logits row of the step (the runner's sampling rows: per sampling request in
    batch order, its last token, then one row per draft); rows of unconstrained requests allow everything.
    With host logits the fill thread also works out how to write the mask
    (:class:`~tokenmill.structured_output.xgrammar_backend.MaskPlan`: the rows unpacked, the allowed ids of
    the rows that allow few), so the critical path only writes the ``-inf``s.

    The fill starts when the runner starts the forward (:meth:`start`), not when the step is scheduled: on the
    2-core CPU a fill started earlier ran beside the runner's input preparation (Python) and slowed it by the
    GIL (``prepare`` 1.19 vs 0.70 ms per step at c=16, AVX2 EPYC); started at the forward it runs beside the
    kernels, which release the GIL. Anything that needs the mask before :meth:`start` (a worker process's
    copy, :meth:`result`) fills it then.

    Attributes:
        rows: the constrained rows (the ones :meth:`apply` masks), ascending.
    """

    def __init__(self, manager: "StructuredOutputManager", rows: list[int], submit: Callable[[], Future]) -> None:
        self.manager = manager
        self.rows = rows
        self._submit: Callable[[], Future] | None = submit
        self._future: Future | None = None
        self._bitmask: Any = None
        self._plan: Any = None

    def start(self) -> None:
        """Start filling on the manager's worker thread (idempotent; the runner calls it as the forward starts)."""
        if self._future is None and self._submit is not None and self._bitmask is None:
            self._future = self._submit()
            self._submit = None

    def _wait(self) -> None:
        if self._bitmask is None:
            self.start()
            t0 = time.perf_counter()
            self._bitmask, self._plan = self._future.result()
            if self.manager is not None:
                self.manager.stats.mask_wait_time += time.perf_counter() - t0

    def result(self) -> Any:
        """The ``[num_sampling_rows, ceil(V / 32)]`` int32 bitmask (waits for the fill; its wait is counted)."""
        self._wait()
        return self._bitmask

    def apply(self, logits: Any, defer_sparse: bool = False) -> Any:
        """Mask ``logits`` (``[num_sampling_rows, V]`` float, in place): disallowed tokens become ``-inf``.

        Args:
            defer_sparse: leave the rows that allow few tokens unwritten (host float32 logits) and return
                their mask, for a greedy sampler (:class:`~tokenmill.model.sampler.Sampler`'s ``deferred``).
        Returns:
            the deferred :class:`~tokenmill.structured_output.xgrammar_backend.SparseRowsMask`, or None.
        """
        from tokenmill.structured_output.xgrammar_backend import apply_token_bitmask

        self._wait()
        return apply_token_bitmask(logits, self._bitmask, self.rows, self._plan, defer_sparse=defer_sparse)

    def __getstate__(self) -> dict:
        # crossing to a worker process (tensor/pipeline parallel): the filled packed bitmask travels (1/8 the
        # bytes of the unpacked one), not the thread; the worker unpacks it when it applies it
        self._wait()
        return {"rows": self.rows, "_bitmask": self._bitmask, "_plan": None, "manager": None,
                "_future": None, "_submit": None}


class StructuredOutputManager:
    """Compiles constraints and drives every constrained request's matcher (see the module docstring).

    Args:
        config: the :class:`~tokenmill.config.StructuredOutputsConfig`.
        vocab_size: the model's logits width.
        eos_token_ids: the model's end-of-sequence ids (the grammar's stop tokens).
        tokenizer: the model's Hugging Face tokenizer, or a zero-argument callable that loads it (called on
            the compile thread with the first constrained request, so start-up pays nothing).
        backend_factory: ``(tokenizer, vocab_size, eos_token_ids, config) -> StructuredOutputBackend``
            (default: the configured backend).
        host_logits: the logits are CPU tensors (the fill thread then also unpacks the mask for the apply).

    Attributes:
        stats: :class:`StructuredOutputStats`.
        num_forced_draft_tokens: the most forced tokens a request verifies as drafts per step (0: off).
        forced_draft_max_batch: forced drafts only in steps with at most this many running requests.
    """

    def __init__(self, config: Any, vocab_size: int, eos_token_ids: list[int], tokenizer: Any,
                 backend_factory: Callable[..., StructuredOutputBackend] | None = None,
                 host_logits: bool = True) -> None:
        self.config = config
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = tokenizer
        self._backend_factory = backend_factory or make_backend
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self._cache: dict[tuple, Future] = {}
        self._compile_started: dict[tuple, float] = {}   # monotonic start of each running compile
        self._states: dict[str, _RequestState] = {}
        self.stats = StructuredOutputStats()
        self.num_forced_draft_tokens = int(getattr(config, "num_forced_draft_tokens", 0))
        self.forced_draft_max_batch = int(getattr(config, "forced_draft_max_batch", 1 << 30))
        self.compile_timeout_s = float(getattr(config, "compile_timeout_s", 30.0))
        self.host_logits = bool(host_logits)
        # forced string -> the tokens the model last wrote it with (forced drafts learned from outputs)
        self.learn_forced = bool(getattr(config, "learn_forced_splits", True))
        self._learned: dict[bytes, list[int]] = {}
        self._token_bytes: Any = None

    # -- backend and compiling -----------------------------------------------------------------
    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (loads the tokenizer and the grammar library)."""
        with self._backend_lock:
            if self._backend is None:
                tok = self._tokenizer() if callable(self._tokenizer) and not hasattr(self._tokenizer, "encode") \
                    else self._tokenizer
                t0 = time.perf_counter()
                self._backend = self._backend_factory(tok, self.vocab_size, self.eos_token_ids, self.config)
                logger.info("structured outputs: %s backend ready in %.2f s (vocabulary %d)", self._backend.name,
                            time.perf_counter() - t0, self.vocab_size)
            return self._backend

    def _compile(self, params: StructuredOutputsParams, key: tuple) -> Any:
        backend = self.backend          # the first request builds it: not counted in its compile time
        t0 = time.perf_counter()
        self._compile_started[key] = time.monotonic()
        try:
            compiled = backend.compile(params)
        finally:
            self._compile_started.pop(key, None)
        self.stats.observe_compile(time.perf_counter() - t0)
        return compiled

    def _submit(self, params: StructuredOutputsParams, key: tuple) -> Future:
        """The compile future of ``params``' constraint: cached, or newly submitted to the pool."""
        self.stats.cache_queries += 1
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None
                                    and not isinstance(fut.exception(), StructuredOutputError)):
            self.stats.cache_hits += 1
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, int(getattr(self.config, "max_compile_threads", 2))),
                                            thread_name_prefix="tokenmill-grammar")
        fut = self._pool.submit(self._compile, params, key)
        self._cache[key] = fut
        return fut

    # -- request life cycle (called by the scheduler) --------------------------------------------
    def add_request(self, req: Any) -> None:
        """Start compiling ``req``'s constraint (``req.sampling_params.structured_outputs``)."""
        params = req.sampling_params.structured_outputs
        kind = params.kind
        self.stats.requests_by_kind[kind] = self.stats.requests_by_kind.get(kind, 0) + 1
        key = constraint_key(params, self.config)
        self._states[req.request_id] = _RequestState(req.request_id, self._submit(params, key), key)

    def poll(self, req: Any) -> str | None:
        """Where ``req``'s grammar stands: ``"ready"`` (its matcher exists), None (still compiling), or an
        error message (the request must fail with HTTP 400)."""
        st = self._states.get(req.request_id)
        if st is None:
            return "structured outputs: the request's grammar state is missing"
        if st.matcher is not None:
            return "ready"
        if not st.future.done():
            started = self._compile_started.get(st.key)
            if started is not None and time.monotonic() - started > self.compile_timeout_s:
                self.stats.compile_timeouts += 1
                return (f"structured outputs: compiling the grammar took longer than {self.compile_timeout_s:g} s "
                        "(compile_timeout_s); simplify the constraint")
            return None
        e = st.future.exception()
        if e is not None:
            if isinstance(e, StructuredOutputError):
                self.stats.compile_failures += 1
                return str(e)
            logger.error("structured outputs: backend failed to compile for %s: %r", req.request_id, e)
            return f"structured outputs: the {getattr(self.config, 'backend', 'grammar')} backend failed: {e}"
        st.matcher = self.backend.new_matcher(st.future.result())
        st.num_accepted = 0
        self._sync(req, st)
        return "ready"

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a running compile finishes or ``timeout`` seconds pass (an idle engine's wait)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = {st.future for st in self._states.values() if st.matcher is None and not st.future.done()}
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def free(self, req_id: str) -> None:
        """Forget a finished or aborted request."""
        self._states.pop(req_id, None)

    def has(self, req_id: str) -> bool:
        return req_id in self._states

    def _sync(self, req: Any, st: _RequestState) -> None:
        """Rebuild the matcher from the request's output tokens when they disagree (it never lost them here,
        but a request may arrive with output tokens, e.g. resumed elsewhere)."""
        out = req.output_token_ids
        if st.num_accepted == len(out):
            return
        m = st.matcher
        m.reset()
        st.num_accepted = m.accept_tokens(out)
        if st.num_accepted != len(out):
            logger.warning("structured outputs: request %s has output tokens its grammar refuses (at %d of %d)",
                           req.request_id, st.num_accepted, len(out))
            st.num_accepted = len(out)     # never rebuild in a loop: the mask continues from the valid prefix

    def accept(self, req: Any, tokens: list[int]) -> bool:
        """Advance ``req``'s matcher by the step's emitted tokens (already appended to its output).

        Returns:
            True when the matcher is now terminated (its stop token was accepted, or nothing may follow).
        """
        st = self._states.get(req.request_id)
        if st is None or st.matcher is None:
            return False
        base = len(req.output_token_ids) - len(tokens)
        if st.num_accepted != base:
            self._sync(req, st)         # out of step: rebuild from all output tokens
        else:
            n = st.matcher.accept_tokens(tokens)
            st.num_accepted += n
            if n != len(tokens):        # a masked sample cannot do this; logged, and the mask goes on from here
                logger.error("structured outputs: request %s emitted token %d that its grammar refuses",
                             req.request_id, tokens[n])
                st.num_accepted = len(req.output_token_ids)
        if st.trace is not None:
            self._follow(st, tokens)
        return st.matcher.is_terminated()

    MAX_LEARNED = 4096

    def _follow(self, st: _RequestState, tokens: list[int]) -> None:
        """Advance the request's forced-string trace by the tokens it emitted; once the model's tokens leave
        the string (it is complete, or a token runs past its end), remember how the model split it."""
        tr, vocab = st.trace, self._token_bytes
        for t in tokens:
            b = vocab[t] if 0 <= t < len(vocab) else b""
            if b and tr.text.startswith(b, tr.pos):
                tr.tokens.append(t)
                tr.pos += len(b)
                if tr.pos < len(tr.text):
                    continue
            if tr.tokens:
                if len(self._learned) >= self.MAX_LEARNED:
                    self._learned.clear()
                self._learned[tr.text] = tr.tokens
            st.trace = None
            return

    def drafts(self, req: Any, proposed: list[int], max_forced: int) -> tuple[list[int], bool]:
        """The drafts ``req`` verifies next step, and whether they are grammar-forced.

        Forced tokens (at most ``max_forced``; 0: none) win; otherwise ``proposed`` (the speculative
        proposer's) is cut to its longest prefix the grammar allows.
        """
        st = self._states.get(req.request_id)
        if st is None or st.matcher is None or st.matcher.is_terminated():
            return [], False
        if max_forced > 0:
            forced = self._forced(st, max_forced)
            if forced:
                forced = forced[:st.matcher.validate_tokens(forced)]
                if forced:
                    return forced, True
        if proposed:
            return proposed[:st.matcher.validate_tokens(proposed)], False
        return [], False

    def _forced(self, st: _RequestState, k: int) -> list[int]:
        """Up to ``k`` draft tokens for the string the grammar forces next.

        Where the model has written this forced string before (this request or another: JSON keys repeat),
        the drafts are the tokens it wrote it with, which under the mask are often not the tokenizer's own
        split (``sub`` ``script`` ``ion`` for ``subscription``), the rest of that split when the request is
        part-way through the string; otherwise the backend's tokens for it (the tokenizer's split). The
        tokens are only drafts: the model verifies every one (the idea of drafting from earlier outputs is
        SuffixDecoding's, Oliaro et al., arXiv 2411.04975; here the grammar says where the text is fixed).
        """
        m = st.matcher
        if not self.learn_forced:
            return m.forced_tokens(k)
        if self._token_bytes is None:
            self._token_bytes = self.backend.token_bytes() or ()
            if not self._token_bytes:
                self.learn_forced = False
                return m.forced_tokens(k)
        text = m.forced_string()
        if not text:
            st.trace = None
            return []
        tr = st.trace
        if tr is None or tr.text[tr.pos:] != text:
            tr = st.trace = _Trace(text)
        learned = self._learned.get(tr.text)
        n = len(tr.tokens)
        if learned is not None and len(learned) > n and learned[:n] == tr.tokens:
            return learned[n:n + k]
        learned = self._learned.get(text) if n else None
        if learned is not None:
            return learned[:k]
        return m.forced_tokens_for(text, k)

    def observe_forced(self, num_drafts: int, num_accepted: int) -> None:
        """Count a step's verified forced drafts (``num_drafts`` scheduled, ``num_accepted`` kept)."""
        self.stats.forced_draft_tokens += num_drafts
        self.stats.forced_accepted_tokens += num_accepted

    # -- the step's bitmask ---------------------------------------------------------------------------
    def grammar_bitmask(self, scheduler_output: Any) -> GrammarBitmask | None:
        """Start filling the bitmask of this step's constrained sampling rows; None when there are none.

        Row layout (the runner's ``logits`` rows): per sampling request in batch order, ``1 +
        len(spec_token_ids)`` rows. The fill runs on one worker thread (xgrammar releases the GIL), so it
        overlaps the forward; :meth:`GrammarBitmask.result` waits for it.
        """
        jobs: list[tuple[GrammarMatcher, list[int], int]] = []
        rows: list[int] = []
        row = 0
        for sr in scheduler_output.scheduled:
            if not sr.sample:
                continue
            k = len(sr.spec_token_ids)
            st = self._states.get(sr.req_id)
            if st is not None and st.matcher is not None:
                jobs.append((st.matcher, list(sr.spec_token_ids), row))
                rows.extend(range(row, row + k + 1))
            row += k + 1
        if not jobs:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-bitmask")
        pool = self._mask_thread
        return GrammarBitmask(self, rows, lambda: pool.submit(self._fill, jobs, row, rows))

    def _fill(self, jobs: list[tuple[GrammarMatcher, list[int], int]], total_rows: int,
              rows: list[int]) -> tuple[Any, Any]:
        """Fill the step's bitmask (worker thread): every request's first row in one batched backend call,
        then the draft rows request by request (accept the draft, fill, and finally roll back); with host
        logits, also make the :class:`~tokenmill.structured_output.xgrammar_backend.MaskPlan` that
        :meth:`GrammarBitmask.apply` writes.

        Returns:
            ``(bitmask, plan or None)``.
        """
        t0 = time.perf_counter()
        backend = self.backend
        bitmask = backend.allocate_bitmask(total_rows)       # all bits set: unconstrained rows allow all
        backend.fill_bitmasks([m for m, _, _ in jobs], bitmask, [r for _, _, r in jobs])
        for m, drafts, r in jobs:
            if not drafts:
                continue
            r += 1
            accepted = 0
            for t in drafts:
                if not m.accept_token(t):    # never for validated drafts; the row then allows what row r-1 did
                    break
                accepted += 1
                m.fill_bitmask(bitmask, r)
                r += 1
            for _ in range(len(drafts) - accepted):
                bitmask[r] = bitmask[r - 1]
                r += 1
            m.rollback(accepted)
        plan = None
        if self.host_logits:
            from tokenmill.structured_output.xgrammar_backend import MaskPlan

            plan = MaskPlan(bitmask, rows)
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)
        self.stats.mask_fill_time += time.perf_counter() - t0
        return bitmask, plan

    def shutdown(self) -> None:
        """Stop the worker threads (a compile in progress finishes in the background)."""
        for pool in (self._pool, self._mask_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._mask_thread = None


def make_backend(tokenizer: Any, vocab_size: int, eos_token_ids: list[int], config: Any) -> StructuredOutputBackend:
    """The backend ``config.backend`` names (``xgrammar``, or ``guidance`` when llguidance is installed).

    Raises:
        ValueError: an unknown backend, or ``guidance`` without the ``llguidance`` package.
    """
    name = getattr(config, "backend", "xgrammar")
    if not vocab_size:
        vocab_size = len(tokenizer)
    if name == "xgrammar":
        from tokenmill.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, eos_token_ids, config)
    if name == "guidance":
        from tokenmill.structured_output.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, eos_token_ids, config)
    raise ValueError(f"unknown structured outputs backend {name!r}")
