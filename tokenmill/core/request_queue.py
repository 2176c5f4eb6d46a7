"""The scheduler's waiting queues: arrival order (``fcfs``), priority order, and the two lanes.

:class:`LanedQueue` holds an interactive and a batch-lane queue of the policy's kind
(:class:`FCFSQueue` or :class:`PriorityQueue`) and keeps per-lane, per-priority request and token
counts, so :meth:`tokenmill.core.scheduler.Scheduler.queue_state` costs nothing per waiting request.
Pure Python (the ``core`` layer).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from tokenmill.core.request import Request


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Order by ``(priority, arrival_time, sequence number)``; lower first.

    A preempted request keeps its key, which already orders it before every
    later arrival of the same priority, so it needs no special "front".
    """

    def __init__(self, seq_of: dict[str, int]) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq_of = seq_of

    def _key(self, req: Request) -> tuple[int, float, int, Request]:
        return (req.priority, req.arrival_time, self._seq_of[req.request_id], req)

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, self._key(req))

    add_front = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class LanedQueue:
    """Two waiting queues, interactive before batch (the batch lane), with per-priority token counts.

    ``peek``/``pop`` serve the interactive queue while it holds a request, the
    batch queue only when it is empty, so a batch-lane request is admitted
    only with the budget, seats and blocks interactive requests leave. Both
    lanes follow the scheduling policy inside. The counts (requests and
    prompt tokens still to prefill, by lane and priority) are kept on every
    change, so :meth:`tokenmill.core.scheduler.Scheduler.queue_state` costs nothing per waiting request.
    """

    def __init__(self, make_queue) -> None:  # noqa: ANN001 - a queue class factory
        self.interactive = make_queue()
        self.batch = make_queue()
        # (batch lane?, priority) -> [requests, tokens]
        self.counts: dict[tuple[bool, int], list[int]] = {}
        self._counted: dict[str, int] = {}

    def _lane(self, req: Request):
        return self.batch if req.batch else self.interactive

    def _count(self, req: Request, sign: int) -> None:
        if sign > 0:
            tokens = self._counted[req.request_id] = req.num_tokens
        else:
            tokens = self._counted.pop(req.request_id, 0)
        c = self.counts.setdefault((req.batch, req.priority), [0, 0])
        c[0] += sign
        c[1] += sign * tokens
        if c[0] == 0:
            del self.counts[(req.batch, req.priority)]

    def add(self, req: Request) -> None:
        self._lane(req).add(req)
        self._count(req, +1)

    def add_front(self, req: Request) -> None:
        self._lane(req).add_front(req)
        self._count(req, +1)

    def peek(self) -> Request:
        return self.interactive.peek() if len(self.interactive) else self.batch.peek()

    def pop(self) -> Request:
        req = self.interactive.pop() if len(self.interactive) else self.batch.pop()
        self._count(req, -1)
        return req

    def remove(self, req: Request) -> None:
        self._lane(req).remove(req)
        self._count(req, -1)

    def __len__(self) -> int:
        return len(self.interactive) + len(self.batch)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self.interactive, self.batch)
