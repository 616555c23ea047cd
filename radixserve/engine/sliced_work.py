"""Work that reads the engine's state in small slices between steps (cache views).

A view of the cache (the tree route, an event stream's first snapshot) must read state that
only the engine thread may touch, but reading all of a large tree at once would hold up
every request for as long as it takes. So such work is a generator: each `next()` does a
bounded piece (a few dozen nodes) and yields; the engine thread runs pieces between its
steps until `budget_s` has passed, then steps again. The generator's return value is the
result. Work whose `cancelled()` turns true (its caller left) is dropped before its next
piece, so a closed client's work stops.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

DEFAULT_BUDGET_S = 0.001  # engine-thread time per step given to views, all of them together

SlicedGenerator = Generator[None, None, Any]


@dataclass
class SlicedTask:
    """A generator of pieces, what to do with its result or error, and whether to drop it."""

    work: SlicedGenerator
    done: Callable[[Any, BaseException | None], None]
    cancelled: Callable[[], bool]


class SlicedWork:
    """The engine thread's queue of sliced tasks, run round-robin within a time budget."""

    def __init__(self, budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._tasks: deque[SlicedTask] = deque()
        self.pieces = 0  # pieces run so far (for stats and tests)

    def add(self, task: SlicedTask) -> None:
        """Queues a task (engine thread)."""
        self._tasks.append(task)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def run(self) -> None:
        """Runs pieces, one task after another, until the budget is spent or nothing is left;
        at least one piece when there is any."""
        deadline = time.perf_counter() + self.budget_s
        while self._tasks:
            task = self._tasks.popleft()
            if task.cancelled():
                task.work.close()
                continue
            self.pieces += 1
            try:
                next(task.work)
            except StopIteration as stop:
                task.done(stop.value, None)
            except Exception as error:  # handed to the caller; the engine carries on
                task.done(None, error)
            else:
                self._tasks.append(task)
            if time.perf_counter() >= deadline:
                return
