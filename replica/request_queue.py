"""The scheduler's waiting queue, one kind per scheduling policy (vLLM v1's request_queue).

fcfs admits in arrival order, and a preempted request goes back to the front, so it
resumes before anyone who arrived after it. priority admits by (priority, arrival
time), lower values first; a preempted request goes back at its place in that order,
which among equal priorities is again ahead of everyone who arrived after it.
"""

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from replica.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A heap of (priority, arrival_time, tie, request): `tie`, a counter, orders requests
    that arrived at the same instant and keeps the heap from ever comparing requests."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._ties = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._ties), request))

    # Its place is by (priority, arrival), as a new request's.
    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return (entry[-1] for entry in sorted(self._heap))
