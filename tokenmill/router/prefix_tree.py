"""An approximate prefix tree of the text a router sent to one backend, LRU-bounded.

The ``prefix_aware`` policy cannot see a backend's cache; it remembers what it
routed there and assumes the backend still holds it. This is SGLang's
cache-aware router (its radix tree over request text, RadixAttention's
structure, arXiv 2312.07104 §3) kept per backend: a compressed radix tree
over characters whose size (characters stored) is bounded; when it grows past
``max_size`` the least recently used leaves are cut until it fits, which
approximates the backend's own LRU eviction.
"""

from __future__ import annotations

import heapq
import itertools
import time


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: str, parent: "_Node | None", now: float) -> None:
        self.key = key
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = now


def _common_prefix_len(a: str, b: str, start_b: int) -> int:
    n = min(len(a), len(b) - start_b)
    i = 0
    # compare in chunks first (fast path for long shared prompts)
    step = 64
    while i + step <= n and a[i:i + step] == b[start_b + i:start_b + i + step]:
        i += step
    while i < n and a[i] == b[start_b + i]:
        i += 1
    return i


class PrefixTree:
    """Radix tree over strings with LRU eviction of leaves.

    Args:
        max_size: most characters kept (sum of edge-label lengths); 0 or less: unbounded.
        clock: time source (seconds), for tests.
    """

    def __init__(self, max_size: int = 2**26, clock=time.monotonic) -> None:
        self.max_size = max_size
        self._clock = clock
        self._tick = itertools.count()
        self.root = _Node("", None, 0.0)
        self.size = 0

    def _now(self) -> float:
        # strictly increasing, so two accesses in one clock tick still order
        return self._clock() + next(self._tick) * 1e-9

    def match(self, text: str, touch: bool = True) -> int:
        """Length of the longest prefix of ``text`` in the tree, in characters.

        ``touch`` marks the matched path as recently used.
        """
        node, pos, now = self.root, 0, self._now()
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            k = _common_prefix_len(child.key, text, pos)
            if touch:
                child.last_access = now
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def insert(self, text: str) -> int:
        """Add ``text`` (marking its whole path as just used); returns characters newly stored.

        Evicts least recently used leaves afterwards if the tree outgrew ``max_size``.
        """
        node, pos, now = self.root, 0, self._now()
        added = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                new = _Node(text[pos:], node, now)
                node.children[text[pos]] = new
                added += len(new.key)
                pos = len(text)
                break
            k = _common_prefix_len(child.key, text, pos)
            if k < len(child.key):  # split the edge at k; the unmatched tail keeps its age
                mid = _Node(child.key[:k], node, now)
                node.children[text[pos]] = mid
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                child = mid
            child.last_access = now
            pos += k
            node = child
        self.size += added
        if self.max_size > 0 and self.size > self.max_size:
            self.evict(self.max_size)
        return added

    def evict(self, target_size: int) -> int:
        """Cut least recently used leaves until ``size <= target_size``; returns characters removed."""
        removed = 0
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > target_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children:
                continue
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            removed += len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return removed

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n

    def clear(self) -> None:
        """Forget everything (e.g. the backend restarted)."""
        self.root = _Node("", None, 0.0)
        self.size = 0
