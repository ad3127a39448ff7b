"""A fake clock for asyncio tests of timing: an event loop whose time jumps.

:class:`VirtualTimeLoop` runs everything that is ready at once; when nothing is, and a timer is
pending, its clock jumps straight to that timer instead of sleeping (trio's "autojump" clock).
So a test of *when* something happens measures the code's own scheduling, exactly, on any
machine: a loaded machine is slower in real time but not in virtual time. While a thread of the
loop's executor (``asyncio.to_thread``) works, the clock does not jump: the loop waits for it in
real time, as a busy process would.

``wall_ns()`` is the matching wall clock (Unix nanoseconds, starting at the real time the loop
was made), for code that reads ``time.time_ns()``.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")


class _JumpingSelector(selectors.BaseSelector):
    """The default selector, except that a wait with nothing ready moves the loop's clock."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._inner = selectors.DefaultSelector()
        self._loop = loop

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self._loop.threads_busy:
            return self._inner.select(timeout)  # a thread works: wait for it in real time
        ready = self._inner.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            return self._inner.select(None)  # no timer at all: only real I/O can come
        self._loop.advance(timeout)
        return []

    def close(self) -> None:
        self._inner.close()

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._inner.get_map()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """See the module docstring. ``time()`` starts at 0 and counts whole microseconds."""

    def __init__(self) -> None:
        self._now_us = 0
        self._wall_origin_ns = time.time_ns()
        self.threads_busy = 0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now_us / 1_000_000

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds`` (rounded up to a whole microsecond, so that the
        timer the loop waits for is due afterwards)."""
        self._now_us += max(0, math.ceil(seconds * 1_000_000))

    def wall_ns(self) -> int:
        return self._wall_origin_ns + self._now_us * 1000

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        self.threads_busy += 1
        future = super().run_in_executor(executor, func, *args)

        def done(_: asyncio.Future[T]) -> None:
            self.threads_busy -= 1

        future.add_done_callback(done)
        return future
