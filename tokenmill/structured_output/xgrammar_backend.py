"""The xgrammar backend (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models", arXiv 2411.15100): JSON schema, regex, choice, EBNF/GBNF or Lark grammars and
structural tags, compiled once per (constraint, tokenizer) by xgrammar's ``GrammarCompiler`` (which keeps
its own compiled-grammar cache) and matched per request by ``GrammarMatcher``.

xgrammar is imported when the backend is built (the first constrained request), never at engine start-up.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import (
    GrammarMatcher, StructuredOutputBackend, StructuredOutputError, disallow_additional_properties,
    resolve_json_options, unproductive_rules,
)

logger = logging.getLogger(__name__)

# xgrammar prefixes its C++ error messages with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def backend_message(e: BaseException) -> str:
    """The backend's own error text, without xgrammar's timestamp and source-file prefix."""
    return _CPP_PREFIX.sub("", str(e)).strip()


def _json_schema_text(params: StructuredOutputsParams, no_extra: bool) -> str:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"structured_outputs.json: not valid JSON ({e})", "json") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError("structured_outputs.json: a JSON schema must be an object", "json")
    if no_extra:
        schema = disallow_additional_properties(schema)
    return json.dumps(schema)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarMatcher(GrammarMatcher):
    """:class:`GrammarMatcher` over an ``xgrammar.GrammarMatcher``.

    Args:
        matcher: the xgrammar matcher.
        encode: ``str -> list[int]``, the model tokenizer's encoding of a forced string (cached by the
            backend); None: xgrammar's own tokenisation of it.
    """

    __slots__ = ("m", "encode")

    def __init__(self, matcher: Any, encode: Any = None) -> None:
        self.m = matcher
        self.encode = encode

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def accept_tokens(self, token_ids: Any) -> int:
        accept = self.m.accept_token         # one bound method for the step's tokens (the base class's loop
        for i, t in enumerate(token_ids):    # goes through accept_token per token)
            if not accept(int(t)):
                return i
        return len(token_ids)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def forced_string(self) -> bytes:
        if self.m.is_terminated():
            return b""
        return self.m.find_jump_forward_string().encode("utf-8", "surrogateescape")

    def forced_tokens(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or self.m.is_terminated():
            return []
        if self.encode is None:
            # xgrammar tokenises the forced string greedily by longest vocabulary token and leaves out a last
            # token that is a strict prefix of a longer one (the text after it could merge into it)
            return list(self.m.find_jump_forward_tokens()[:max_tokens])
        return self.forced_tokens_for(self.forced_string(), max_tokens)

    def forced_tokens_for(self, text: bytes, max_tokens: int) -> list[int]:
        # the model's tokenizer splits the forced string as the model was trained to write it: on the
        # key-heavy benchmark record 0.97 of these drafts match the canonical tokenisation, 0.87 of xgrammar's
        if max_tokens <= 0 or not text:
            return []
        if self.encode is None:
            return list(self.m.find_jump_forward_tokens()[:max_tokens])
        s = text.decode("utf-8", "surrogateescape")
        ids = self.encode(s)
        if s[-1].isspace() and len(ids) > 1:
            # byte-level BPE attaches a space to the word after it (' true', ' 1'): a trailing space token
            # is almost never what the model writes there (seen on the key-heavy benchmark record)
            ids = ids[:-1]
        return list(ids[:max_tokens])

    def reset(self) -> None:
        self.m.reset()


class XgrammarBackend(StructuredOutputBackend):
    """Compiles with ``xgrammar.GrammarCompiler`` for one Hugging Face tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer (its vocabulary, decoded).
        vocab_size: the model's logits width (may exceed the tokenizer's length: padded rows are never allowed).
        stop_token_ids: the model's EOS ids (allowed when the output is complete).
        config: the server's :class:`~tokenmill.config.StructuredOutputsConfig` (whitespace and
            additional-properties defaults, compile threads).

    Raises:
        ImportError: xgrammar is not installed.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], config: Any = None) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.config = config
        self.vocab_size = int(vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=list(stop_token_ids) or None)
        threads = getattr(config, "max_compile_threads", 2)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=True)
        self.tokenizer = tokenizer
        self._encoded: dict[str, list[int]] = {}       # forced string -> its tokens (keys repeat across requests)
        self._batch: Any = None                         # xgrammar's BatchGrammarMatcher, made on first use
        self._token_bytes: list[bytes] | None = None

    # -- compile ---------------------------------------------------------------------------------
    def _max_ws(self, any_ws: bool) -> int | None:
        """xgrammar's ``max_whitespace_cnt`` for a JSON constraint (the config's ``max_whitespace``; None: no limit)."""
        cap = getattr(self.config, "max_whitespace", 0)
        return cap if any_ws and cap > 0 else None

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise StructuredOutputError("structured_outputs.whitespace_pattern is not supported by the xgrammar "
                                        "backend (use disable_any_whitespace)", "whitespace_pattern")
        c = self.compiler
        try:
            if kind == "json":
                any_ws, no_extra = resolve_json_options(params, self.config)
                return c.compile_json_schema(_json_schema_text(params, no_extra), any_whitespace=any_ws,
                                             max_whitespace_cnt=self._max_ws(any_ws))
            if kind == "json_object":
                any_ws, _ = resolve_json_options(params, self.config)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                             max_whitespace_cnt=self._max_ws(any_ws))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(params.choice))
            if kind == "grammar":
                return self._compile_grammar(params.grammar)
            if kind == "structural_tag":
                return self._compile_structural_tag(params.structural_tag)
        except StructuredOutputError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar raises RuntimeError from C++
            what = {"json": "invalid JSON schema", "json_object": "invalid JSON object constraint",
                    "regex": "invalid regex", "choice": "invalid choice", "grammar": "invalid grammar",
                    "structural_tag": "invalid structural tag"}[kind]
            raise StructuredOutputError(f"structured_outputs.{kind}: {what}: {backend_message(e)}", kind) from None
        raise StructuredOutputError(f"structured_outputs: unknown constraint kind {kind!r}")

    def _compile_grammar(self, text: str) -> Any:
        """EBNF/GBNF first (xgrammar's syntax); a grammar that fails as EBNF but parses as Lark is taken as Lark.

        Raises:
            StructuredOutputError: also when a rule reachable from ``root`` can never finish
                (:func:`check_grammar_finishes`).
        """
        check_grammar_finishes(_parse_grammar(self.xgr, text))
        try:
            return self.compiler.compile_grammar(text)
        except RuntimeError as ebnf_error:
            if "::=" in text:
                raise
            try:
                return self.compiler.compile_lark(text)
            except RuntimeError:
                raise ebnf_error from None

    def _compile_structural_tag(self, text: str) -> Any:
        """xgrammar's structural-tag JSON; vLLM's legacy ``{"structures": [{"begin", "schema", "end"}],
        "triggers": [...]}`` form is accepted too."""
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"structured_outputs.structural_tag: not valid JSON ({e})",
                                        "structural_tag") from None
        if isinstance(spec, dict) and "structures" in spec and "triggers" in spec:
            tags = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                    for s in spec["structures"]]
            return self.compiler.compile_structural_tag(tags, spec["triggers"])
        return self.compiler.compile_structural_tag(text)

    # -- matching --------------------------------------------------------------------------------
    def new_matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(self.xgr.GrammarMatcher(compiled), self._encode if hasattr(self.tokenizer, "encode")
                               else None)

    MAX_ENCODED = 4096

    def _encode(self, text: str) -> list[int]:
        """The tokenizer's ids of a forced string, cached (bounded; called from the engine thread only)."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= self.MAX_ENCODED:
                self._encoded.clear()
            ids = self._encoded[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids

    def allocate_bitmask(self, num_rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def token_bytes(self) -> list[bytes]:
        """xgrammar's decoded vocabulary (byte-level BPE undone; special tokens ``b""``), padded to the logits."""
        if self._token_bytes is None:
            special = set(self.tokenizer_info.special_token_ids)
            vocab = [b"" if i in special else bytes(v) for i, v in enumerate(self.tokenizer_info.decoded_vocab)]
            self._token_bytes = vocab + [b""] * max(0, self.vocab_size - len(vocab))
        return self._token_bytes

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Any, rows: list[int]) -> None:
        """One call into xgrammar for the whole batch (``BatchGrammarMatcher.batch_fill_next_token_bitmask``,
        one thread: the forward it overlaps has the cores) instead of a Python call per request."""
        if len(matchers) < 2:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        if self._batch is None:
            self._batch = self.xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask, list(rows))

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        apply_bitmask_torch(logits, bitmask, rows)


def unpack_disallowed(bitmask: Any, rows: list[int] | None = None) -> Any:
    """The disallowed tokens of ``bitmask``'s rows as a numpy bool array (True: the token is refused).

    Args:
        bitmask: ``[N, W]`` int32 CPU tensor or array, bit ``t % 32`` of word ``t // 32`` set when token ``t``
            is allowed.
        rows: the rows to unpack (None: all), in that order.

    Returns:
        ``[len(rows), 32 W]`` ``numpy.bool_`` array (a C-contiguous copy). Little-endian hosts only (the byte
        order of the words decides which byte holds tokens ``0..7``); :func:`apply_token_bitmask` checks.
    """
    import numpy as np

    a = bitmask.numpy() if hasattr(bitmask, "numpy") else np.asarray(bitmask)
    if rows is not None and len(rows) != a.shape[0]:
        a = a[np.asarray(rows, dtype=np.int64)]
    inv = np.ascontiguousarray(np.invert(a))
    return np.unpackbits(inv.view(np.uint8), axis=1, bitorder="little").view(np.bool_)


def row_runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """``rows`` as maximal runs of consecutive rows: ``(first, end, index of first in rows)``."""
    runs: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if runs and runs[-1][1] == r:
            a, _, j = runs[-1]
            runs[-1] = (a, r + 1, j)
        else:
            runs.append((r, r + 1, i))
    return runs


def _popcount_rows(words: Any) -> Any:
    """Set bits per row of a ``[R, W]`` uint32 array (``numpy.bitwise_count`` where numpy has it, numpy >= 2;
    else a byte lookup table)."""
    import numpy as np

    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    table = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
    return table[words.view(np.uint8)].sum(axis=1, dtype=np.int64)


def allowed_ids(words: Any) -> tuple[Any, Any]:
    """The allowed token ids of the rows of a packed bitmask, without unpacking the rows.

    Only the words with a bit set are unpacked (a row that allows few tokens has few such words), so the cost
    follows the allowed tokens, not the row width.

    Args:
        words: ``[R, W]`` uint32 array, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed.

    Returns:
        ``(row, ids)``: two int64 arrays of equal length, the allowed ``(row index, token id)`` pairs in
        ascending order (by row, then id). Little-endian hosts only (as :func:`unpack_disallowed`).
    """
    import numpy as np

    r, w = np.nonzero(words)
    if not len(r):
        return r.astype(np.int64), w.astype(np.int64)
    bits = np.unpackbits(np.ascontiguousarray(words[r, w]).view(np.uint8).reshape(-1, 4), axis=1,
                         bitorder="little")                                   # [K, 32], bit b of word k
    k, b = np.nonzero(bits)
    return r[k].astype(np.int64), w[k].astype(np.int64) * 32 + b


class MaskPlan:
    """How to write one step's mask into host logits, worked out off the critical path (the fill thread).

    A row that allows few tokens (at most :attr:`SPARSE_FRACTION` of its width; a JSON key, punctuation, an
    enum) is written as "save the allowed logits, fill the row with ``-inf``, put them back": a ``fill`` at
    memory speed plus a gather/scatter of a handful of entries, done for all such rows at once (one fill per
    run of consecutive rows, one gather and one scatter for the step). The plan counts each row's allowed
    tokens with a popcount of the packed words and lists a sparse row's allowed ids from its non-zero words
    only (:func:`allowed_ids`); only the other rows (free text inside a string allows almost everything) are
    unpacked, for ``numpy.copyto(where=refused)`` over runs of consecutive rows.

    Attributes:
        sparse_rows: the logits rows that allow few tokens, ascending; ``sparse_runs`` them as
            :func:`row_runs`.
        sparse_row, sparse_ids: int64 arrays, the allowed ``(logits row, token id)`` pairs of those rows.
        dense_rows: the other rows, ascending; ``dense_runs`` them as :func:`row_runs`; ``dense``: their
            refused-token array (``[len, 32 W]`` bool).
        width: ``32 W``, the tokens the bitmask covers.
    """

    SPARSE_FRACTION = 1 / 8

    __slots__ = ("sparse_rows", "sparse_runs", "sparse_row", "sparse_ids", "dense_rows", "dense_runs", "dense",
                 "width")

    def __init__(self, bitmask: Any, rows: list[int]) -> None:
        import numpy as np

        a = bitmask.numpy() if hasattr(bitmask, "numpy") else np.asarray(bitmask)
        self.width = 32 * a.shape[1]
        sub = a if len(rows) == a.shape[0] and rows == list(range(len(rows))) \
            else a[np.asarray(rows, dtype=np.int64)]
        words = sub.view(np.uint32)
        sparse = _popcount_rows(words) <= int(self.width * self.SPARSE_FRACTION)
        rows_a = np.asarray(rows, dtype=np.int64)
        self.sparse_rows = rows_a[sparse].tolist()
        r, self.sparse_ids = allowed_ids(words[sparse] if not sparse.all() else words)
        self.sparse_row = rows_a[sparse][r]
        keep = np.flatnonzero(~sparse)
        self.dense_rows = rows_a[keep].tolist()
        self.dense = unpack_disallowed(sub[keep]) if len(keep) else np.zeros((0, self.width), dtype=np.bool_)
        self.sparse_runs = row_runs(self.sparse_rows)
        self.dense_runs = row_runs(self.dense_rows)


class SparseRowsMask:
    """The mask of a step's sparse rows, left unwritten in the logits (:func:`apply_token_bitmask` with
    ``defer_sparse``): a greedy sampler takes each such row's token as the argmax over its allowed ids only
    (:meth:`argmax`), without the ``[rows, V]`` ``-inf`` write (12.5 MB at 64 rows x 49152 tokens) and the
    full-row argmax read after it; :meth:`write` writes the mask when the sampler needs the full rows.

    Attributes:
        rows: the logits rows concerned, ascending (each allows at least one token; a row allowing none is
            never deferred).
        row, ids: int64 arrays of equal length, the allowed ``(logits row, token id)`` pairs (ids below the
            logits width), ascending by row then id.
        runs: ``rows`` as :func:`row_runs`.
    """

    __slots__ = ("rows", "row", "ids", "runs", "_starts")

    def __init__(self, rows: list[int], row: Any, ids: Any) -> None:
        import numpy as np

        self.rows = rows
        self.row = row
        self.ids = ids
        self.runs = row_runs(rows)
        self._starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]]) if len(row) else row

    def write(self, logits: Any) -> None:
        """``logits[r, t] = -inf`` for every row ``r`` of :attr:`rows` and every token ``t`` it refuses; in
        place (``[N, V]`` contiguous float32 CPU tensor): what :func:`apply_token_bitmask` writes there."""
        _write_sparse_rows(logits.numpy(), self.row, self.ids, self.runs)

    def argmax(self, logits: Any) -> tuple[Any, Any]:
        """Per row of :attr:`rows`: the allowed token with the largest logit (the lowest id among equal
        ones: ``torch.argmax`` of the masked row, whose first maximum it is) and that logit.

        Args:
            logits: ``[N, V]`` contiguous float32 CPU tensor, the rows unmasked.
        Returns:
            ``(ids, values)``: int64 and float32 numpy arrays of ``len(rows)``. A NaN among a row's allowed
            logits gives that row a NaN value (``torch.argmax`` picks a NaN's index too: the caller's finite
            check then refuses the row either way).
        """
        import numpy as np

        ln = logits.numpy()
        vals = ln.reshape(-1)[self.row * ln.shape[1] + self.ids]
        best = np.maximum.reduceat(vals, self._starts)            # NaN propagates
        counts = np.diff(np.r_[self._starts, len(vals)])
        hit = np.flatnonzero(vals == np.repeat(best, counts))    # first maximum per row (none for a NaN row)
        first = np.searchsorted(hit, self._starts)
        first = np.minimum(first, max(len(hit) - 1, 0))
        pos = hit[first] if len(hit) else self._starts
        ok = (pos >= self._starts) & (pos < self._starts + counts)
        pos = np.where(ok, pos, self._starts)
        return self.ids[pos], best


def _write_sparse_rows(ln: Any, row: Any, ids: Any, runs: list[tuple[int, int, int]]) -> None:
    """Sparse rows' mask into ``ln`` (``[N, V]`` contiguous float32 numpy view of the logits), in place: every
    row of ``runs`` to ``-inf`` except its allowed ``(row, ids)`` entries -- one gather of the allowed values,
    one fill per run of consecutive rows, one scatter back."""
    flat = ln.reshape(-1)                       # a view (contiguous)
    at = row * ln.shape[1] + ids
    kept = flat[at]
    for a, b, _ in runs:
        ln[a:b].fill(float("-inf"))
    flat[at] = kept


def apply_token_bitmask(logits: Any, bitmask: Any, rows: list[int], plan: MaskPlan | None = None,
                        defer_sparse: bool = False) -> SparseRowsMask | None:
    """``logits[r, t] = -inf`` for each ``r`` in ``rows`` where bit ``t`` of ``bitmask[r]`` is clear; in place.

    On CPU float32 contiguous logits (little-endian host): numpy, as the :class:`MaskPlan` says (made here,
    or passed in when the fill thread made it). On the quiet 2-core Xeon, 64 key-heavy rows x 49152 tokens:
    ~0.5 ms, against ~14 ms for xgrammar's CPU kernel (``apply_token_bitmask_inplace``, a per-bit loop)
    (``benchmarks/structured_output.py --mask-bench``). Elsewhere (CUDA, other dtypes): a batched torch
    unpack-and-fill (:func:`apply_bitmask_torch`).

    Args:
        logits: ``[N, V]`` float tensor.
        bitmask: ``[N, ceil(V' / 32)]`` int32 tensor, row ``r`` for logits row ``r`` (bit ``t % 32`` of
            word ``t // 32``); narrower than the logits (a padded vocabulary): the extra ids are refused.
        rows: the rows to mask.
        plan: optional :class:`MaskPlan` of ``bitmask`` at ``rows``.
        defer_sparse: leave the rows that allow few tokens unwritten (numpy path only) and return their mask
            (:class:`SparseRowsMask`), for a greedy sampler that takes the argmax over the allowed ids.
    Returns:
        the deferred :class:`SparseRowsMask` (None when nothing was deferred: every row is written).
    """
    import sys

    import numpy as np
    import torch

    if not rows:
        return None
    vocab = logits.shape[1]
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous()
            or sys.byteorder != "little" or bitmask.device.type != "cpu"):
        idx = torch.tensor(rows, dtype=torch.int64, device=bitmask.device)
        apply_bitmask_torch(logits, bitmask.index_select(0, idx), rows)
        return None
    if plan is None:
        plan = MaskPlan(bitmask, rows)
    ln = logits.numpy()
    ninf = -np.inf
    deferred = None
    if plan.sparse_rows:
        row, ids = plan.sparse_row, plan.sparse_ids
        if plan.width > vocab:                  # a bitmask wider than the logits
            inside = ids < vocab
            row, ids = row[inside], ids[inside]
        if defer_sparse and len(np.unique(row)) == len(plan.sparse_rows):   # every row allows a token
            deferred = SparseRowsMask(plan.sparse_rows, row, ids)
    if deferred is None and plan.sparse_rows:
        _write_sparse_rows(ln, row, ids, plan.sparse_runs)
    covered = min(vocab, plan.width)
    for a, b, j in plan.dense_runs:
        np.copyto(ln[a:b, :covered], ninf, where=plan.dense[j:j + b - a, :covered])
        if covered < vocab:         # logits wider than the bitmask: the extra ids are never allowed
            ln[a:b, covered:] = ninf
    return deferred


def apply_bitmask_torch(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is clear; in place, batched.

    Args:
        logits: ``[N, V]`` float tensor.
        bitmask: ``[len(rows), ceil(V / 32)]`` int32 tensor (bit ``t % 32`` of word ``t // 32``).
        rows: logits row per bitmask row.
    """
    import torch

    if not rows:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]     # [R, V]
    if allowed.shape[1] < vocab:        # logits wider than the bitmask: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, idx, sub)


def _parse_grammar(xgr: Any, text: str) -> Any:
    """``xgrammar.Grammar`` of a request's grammar: EBNF, else Lark (raises xgrammar's error for EBNF)."""
    try:
        return xgr.Grammar.from_ebnf(text)
    except RuntimeError:
        if "::=" in text:
            raise
        try:
            return xgr.Grammar.from_lark(text)
        except RuntimeError:
            pass
        raise


def check_grammar_finishes(grammar: Any) -> None:
    """Refuse a grammar with a rule reachable from ``root`` that can never finish (400).

    xgrammar compiles ``root ::= root`` or ``root ::= "a" root`` without complaint; a request under it
    could never complete (no string matches) and would run to ``max_tokens``, or, where the mask allows no
    token at all, have nothing to sample. :func:`~tokenmill.structured_output.backend.unproductive_rules`
    finds such rules in xgrammar's normalised form of the grammar; syntax it does not know skips the check.

    Raises:
        StructuredOutputError: field ``grammar``, naming the rules.
    """
    bad = unproductive_rules(str(grammar))
    if not bad:
        return
    if bad[0] == "root":
        raise StructuredOutputError("structured_outputs.grammar: the grammar matches no string: rule 'root' can "
                                    "never finish (every alternative needs itself or another rule that "
                                    f"cannot finish: {', '.join(bad)})", "grammar")
    raise StructuredOutputError(f"structured_outputs.grammar: rule {bad[0]!r} can never finish (every "
                                f"alternative needs itself or another rule that cannot finish: "
                                f"{', '.join(bad)}); a request entering it could only run to max_tokens", "grammar")


def validate_with_xgrammar(params: StructuredOutputsParams, config: Any = None) -> None:
    """Parse ``params``' constraint with xgrammar without a tokenizer (syntax and schema errors only).

    Raises:
        StructuredOutputError: invalid or unsupported (names the field, carries xgrammar's message).
    """
    import xgrammar as xgr

    kind = params.kind
    if params.whitespace_pattern is not None:
        raise StructuredOutputError("structured_outputs.whitespace_pattern is not supported by the xgrammar "
                                    "backend (use disable_any_whitespace)", "whitespace_pattern")
    try:
        if kind == "json":
            any_ws, no_extra = resolve_json_options(params, config)
            xgr.Grammar.from_json_schema(_json_schema_text(params, no_extra), any_whitespace=any_ws)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        elif kind == "grammar":
            check_grammar_finishes(_parse_grammar(xgr, params.grammar))
        elif kind == "structural_tag":
            spec = json.loads(params.structural_tag)
            if not (isinstance(spec, dict) and "structures" in spec):
                xgr.Grammar.from_structural_tag(params.structural_tag)
    except StructuredOutputError:
        raise
    except json.JSONDecodeError as e:
        raise StructuredOutputError(f"structured_outputs.{kind}: not valid JSON ({e})", kind) from None
    except (RuntimeError, ValueError, TypeError) as e:
        raise StructuredOutputError(f"structured_outputs.{kind}: {backend_message(e)}", kind) from None
