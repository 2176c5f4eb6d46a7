"""N-gram (prompt lookup) proposer, vectorised over the batch with numpy.

Prompt lookup decoding (Saxena, 2023; vLLM's ``ngram`` method): find the most
recent earlier occurrence of the context's last ``n`` tokens, for the largest
``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that occurs, and propose
the up to ``k`` tokens that followed it. Output that copies or edits the
prompt (summaries, code edits, RAG answers) is drafted for free.

The search runs for every request of a step at once: with the batch's token
ids in a ``[B, L]`` array, ``max_n`` shifted comparisons against each row's
suffix give, for every end position ``e``, the length of the common suffix of
``tokens[:e + 1]`` and the whole context (capped at ``max_n``). No Python loop
runs per token; the loop over requests only slices the results.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenTable:
    """Per-request token ids in one growable ``[rows, width]`` int64 array (the runner's copy of each context).

    Rows are assigned on first use and freed by :meth:`remove`; a request's row
    is brought up to date incrementally by :meth:`sync` (only new tokens are
    written), so a step costs O(new tokens), not O(context).

    Args:
        width: initial row width in tokens (grows by doubling when exceeded).
    """

    def __init__(self, width: int = 1024) -> None:
        self.tokens = np.zeros((8, max(1, width)), dtype=np.int64)
        self.lengths = np.zeros(8, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free: list[int] = list(range(7, -1, -1))

    def _grow(self, rows: int, width: int) -> None:
        r0, w0 = self.tokens.shape
        r1, w1 = max(r0, rows), max(w0, width)
        if (r1, w1) == (r0, w0):
            return
        r1 = max(r1, 2 * r0) if r1 > r0 else r0
        w1 = max(w1, 2 * w0) if w1 > w0 else w0
        t = np.zeros((r1, w1), dtype=np.int64)
        t[:r0, :w0] = self.tokens
        self.tokens = t
        lens = np.zeros(r1, dtype=np.int64)
        lens[:r0] = self.lengths
        self.lengths = lens
        self._free = list(range(r1 - 1, r0 - 1, -1)) + self._free

    def sync(self, req_id: str, prompt: Sequence[int], output: Sequence[int], extra: Sequence[int] = (),
             reset: bool = False) -> int:
        """Make the request's row equal ``prompt + output + extra``; returns its row.

        Only tokens past the stored length are written, unless the stored
        length disagrees with ``len(prompt) + len(output)`` (or ``reset``),
        in which case the row is rewritten from scratch (after a preemption,
        for instance).
        """
        row = self.row_of.get(req_id)
        if row is None:
            if not self._free:
                self._grow(2 * self.tokens.shape[0], 0)
            row = self.row_of[req_id] = self._free.pop()
            reset = True
        base = len(prompt) + len(output)
        total = base + len(extra)
        if total > self.tokens.shape[1]:
            self._grow(0, total)
        have = int(self.lengths[row])
        t = self.tokens[row]
        if reset or have > base or (have < len(prompt)):
            t[:len(prompt)] = prompt
            have = len(prompt)
        if have < base:
            t[have:base] = output[have - len(prompt):]
        if extra:
            t[base:total] = extra
        self.lengths[row] = total
        return row

    def remove(self, req_id: str) -> None:
        """Free the request's row (unknown ids are ignored)."""
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.lengths[row] = 0
            self._free.append(row)


class NgramProposer:
    """Propose draft tokens by prompt lookup for a batch of requests.

    Args:
        min_n, max_n: n-gram sizes tried (``prompt_lookup_min`` / ``_max``).

    Raises:
        ValueError: ``min_n < 1`` or ``min_n > max_n``.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if min_n < 1 or min_n > max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, lengths: np.ndarray, k: np.ndarray | int) -> list[list[int]]:
        """Drafts for every row.

        Args:
            tokens: ``[B, W]`` int token ids; row ``b`` holds its context in
                ``tokens[b, :lengths[b]]`` (the rest is ignored).
            lengths: ``[B]`` context lengths in tokens.
            k: the most draft tokens per row, an int or ``[B]`` ints (0: none).

        Returns:
            ``B`` lists of draft token ids: the (up to ``k[b]``) tokens that
            followed the most recent earlier occurrence of the row's last
            ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that
            occurs; fewer when the context ends sooner; empty when nothing
            matches. The match must end before the last token (the suffix
            itself never counts).
        """
        B = int(tokens.shape[0])
        lengths = np.asarray(lengths, dtype=np.int64)
        kk = np.broadcast_to(np.asarray(k, dtype=np.int64), (B,))
        out: list[list[int]] = [[] for _ in range(B)]
        if B == 0:
            return out
        active = (lengths > self.min_n) & (kk > 0)
        if not active.any():
            return out
        idx = np.nonzero(active)[0]
        lens = lengths[idx]
        W = int(lens.max())
        toks = tokens[idx, :W]
        nb = len(idx)
        rows = np.arange(nb)
        # run[b, e]: tokens[b, e - j] == tokens[b, L_b - 1 - j] for every j so far; mlen counts them.
        run = np.ones((nb, W), dtype=bool)
        mlen = np.zeros((nb, W), dtype=np.int8)
        for j in range(self.max_n):
            ok_row = lens - 1 - j >= 0
            s = toks[rows, np.maximum(lens - 1 - j, 0)]
            eq = np.zeros((nb, W), dtype=bool)
            np.equal(toks[:, :W - j], s[:, None], out=eq[:, j:])
            eq &= ok_row[:, None]
            run &= eq
            if not run.any():
                break
            mlen += run
        # A usable match ends at e <= L - 2 (a next token exists; the suffix itself is excluded).
        pos = np.arange(W)
        mlen[pos[None, :] > (lens - 2)[:, None]] = 0
        best = mlen.max(axis=1)                                    # [nb] longest n available
        has = best >= self.min_n
        if not has.any():
            return out
        hit = mlen == best[:, None]
        last_e = W - 1 - np.argmax(hit[:, ::-1], axis=1)           # most recent end of a longest match
        for b in np.nonzero(has)[0].tolist():
            start = int(last_e[b]) + 1
            stop = min(start + int(kk[idx[b]]), int(lens[b]))
            out[int(idx[b])] = toks[b, start:stop].tolist()
        return out
