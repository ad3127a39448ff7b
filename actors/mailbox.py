"""Small replacements for ``asyncio.Queue`` and ``asyncio.Event`` in per-partition actors.

A task runs one partition reader per partition it reads, thousands of them, and most of them are
idle: their mailbox stays empty and their wake-up flag is rarely used. ``asyncio.Queue`` allocates
three deques up front (about 2.3 KB) and ``asyncio.Event`` one (about 0.8 KB). :class:`Mailbox`
and :class:`Flag` have the same behaviour for what the actors use, and allocate their buffers
only when something is put in or waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Flag", "Mailbox"]


def _wake_one(waiters: list[asyncio.Future[None]] | None) -> None:
    while waiters:
        waiter = waiters.pop(0)
        if not waiter.done():
            waiter.set_result(None)
            return


class Mailbox(Generic[T]):
    """A bounded FIFO queue (``maxsize <= 0``: unbounded) with ``asyncio.Queue``'s semantics for
    ``put``/``put_nowait``/``get``/``get_nowait``: ``put`` waits while it is full, ``get`` while it
    is empty, ``put_nowait``/``get_nowait`` raise ``asyncio.QueueFull``/``asyncio.QueueEmpty``."""

    __slots__ = ("_getters", "_items", "_putters", "maxsize")

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = maxsize
        self._items: deque[T] | None = None
        self._getters: list[asyncio.Future[None]] | None = None
        self._putters: list[asyncio.Future[None]] | None = None

    def qsize(self) -> int:
        return 0 if self._items is None else len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self.maxsize <= self.qsize()

    def put_nowait(self, item: T) -> None:
        if self.full():
            raise asyncio.QueueFull
        if self._items is None:
            self._items = deque()
        self._items.append(item)
        _wake_one(self._getters)

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        _wake_one(self._putters)
        return item

    async def put(self, item: T) -> None:
        while self.full():
            if self._putters is None:
                self._putters = []
            await self._wait(self._putters, lambda: not self.full())
        self.put_nowait(item)

    async def get(self) -> T:
        while self.empty():
            if self._getters is None:
                self._getters = []
            await self._wait(self._getters, lambda: not self.empty())
        return self.get_nowait()

    @staticmethod
    async def _wait(waiters: list[asyncio.Future[None]], ready: Callable[[], bool]) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            waiter.cancel()
            if waiter in waiters:
                waiters.remove(waiter)
            elif not waiter.cancelled() and ready():
                # woken, then cancelled before it could act: pass the wake-up on
                _wake_one(waiters)
            raise


class Flag:
    """``asyncio.Event``'s ``set``/``clear``/``is_set``/``wait``, its waiter list made only
    when something waits."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if self._set:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)
