"""The actor kernel: bounded mailboxes, ``tell`` / ``ask``, lifecycle hooks, supervision.

* Every actor owns one bounded mailbox: ``tell`` waits while it is full (backpressure flows back to
  whoever produces too fast); ``tell_nowait`` raises :class:`MailboxFull` instead.
* ``ask`` sends a message with a future and waits for what ``receive`` returns (or raises).
* ``on_start`` runs before the first message, ``on_stop`` after the last, ``on_failure`` when
  ``receive`` raises; the exception then propagates to the supervisor's task group, which cancels
  the siblings: a failure is never swallowed.
* When an actor stops, every message still in its mailbox that carries an ``ask`` fails with
  :class:`ActorDead`, and so does every later ``tell``/``ask``.
* :class:`Supervisor` roots actors and helper loops in one ``asyncio.TaskGroup``: no orphan tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import msgspec

from actors.mailbox import Flag, Mailbox

log = logging.getLogger("shoal.actors")

M = TypeVar("M")


class ActorDead(Exception):
    """The actor has stopped; it takes no more messages."""

    def __init__(self, name: str) -> None:
        super().__init__(f"actor {name!r} is dead")
        self.name = name


class MailboxFull(Exception):
    """``tell_nowait`` on a full mailbox."""


class MailboxStats(msgspec.Struct, frozen=True):
    name: str
    depth: int
    capacity: int
    received: int
    failed: int


class _Ask:
    __slots__ = ("future", "message")

    def __init__(self, message: object, future: asyncio.Future[Any]) -> None:
        self.message = message
        self.future = future


_STOP = object()


class Actor(Generic[M]):
    """Subclass and implement :meth:`receive`. Start it with :meth:`Supervisor.spawn`."""

    def __init__(self, name: str, capacity: int = 1024) -> None:
        self.name = name
        self._queue: Mailbox[object] = Mailbox(capacity)
        self._capacity = capacity
        self._dead = False
        self._received = 0
        self._failed = 0
        self.started = Flag()

    # -- hooks ------------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Runs before the first message."""

    async def on_stop(self) -> None:
        """Runs after the last message (also after a failure)."""

    async def on_failure(self, exc: BaseException) -> None:
        """Runs when :meth:`receive` raised; the exception propagates afterwards."""
        log.error("actor %s failed: %r", self.name, exc)

    async def receive(self, message: M) -> Any:
        raise NotImplementedError

    # -- sending ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._dead

    async def tell(self, message: M) -> None:
        if self._dead:
            raise ActorDead(self.name)
        await self._queue.put(message)

    def tell_nowait(self, message: M) -> None:
        if self._dead:
            raise ActorDead(self.name)
        try:
            self._queue.put_nowait(message)
        except asyncio.QueueFull as exc:
            raise MailboxFull(f"mailbox of {self.name!r} is full ({self._capacity})") from exc

    async def ask(self, message: M, timeout: float | None = None) -> Any:
        if self._dead:
            raise ActorDead(self.name)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Ask(message, future))
        async with asyncio.timeout(timeout):
            return await future

    def stop(self) -> None:
        """Ask the actor to stop once it has handled what is already in its mailbox."""
        if self._dead:
            return
        try:
            self._queue.put_nowait(_STOP)
        except asyncio.QueueFull:
            self._dead = True  # full: the loop sees _dead after its current message

    async def next_message(self) -> M | None:
        """For an actor that runs its own loop (overrides :meth:`run`): the next message told
        to it, or None once :meth:`stop` was called. Asks are refused (they fail with
        ``TypeError``): such an actor only takes ``tell``s."""
        while True:
            item = await self._queue.get()
            if item is _STOP:
                return None
            if isinstance(item, _Ask):
                if not item.future.done():
                    item.future.set_exception(TypeError(f"actor {self.name!r} takes no asks"))
                continue
            return item  # type: ignore[return-value]

    def close(self) -> None:
        """For an actor that runs its own loop: it is dead from now on (``alive`` is False,
        every ``tell`` fails), and asks still in its mailbox fail with :class:`ActorDead`."""
        self._dead = True
        self._fail_pending()

    def statistics(self) -> MailboxStats:
        return MailboxStats(
            self.name, self._queue.qsize(), self._capacity, self._received, self._failed
        )

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self.on_start()
            self.started.set()
            while not self._dead:
                item = await self._queue.get()
                if item is _STOP:
                    break
                await self._handle(item)
        finally:
            self._dead = True
            self._fail_pending()
            await self.on_stop()

    async def _handle(self, item: object) -> None:
        self._received += 1
        if isinstance(item, _Ask):
            try:
                result = await self.receive(item.message)  # type: ignore[arg-type]
            except Exception as exc:
                self._failed += 1
                if not item.future.done():
                    item.future.set_exception(exc)
                await self.on_failure(exc)
                raise
            if not item.future.done():
                item.future.set_result(result)
            return
        try:
            await self.receive(item)  # type: ignore[arg-type]
        except Exception as exc:
            self._failed += 1
            await self.on_failure(exc)
            raise

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if isinstance(item, _Ask) and not item.future.done():
                item.future.set_exception(ActorDead(self.name))


class Supervisor:
    """Roots actors and helper loops in one task group.

    Leaving the block normally cancels the daemon loops, then stops the actors one at a time in
    reverse start order, each after the one started after it has finished: an actor may still
    tell the actors it was started after (its dependencies) while it handles what is left in its
    mailbox. Leaving on an exception cancels everything at once, as a task group does."""

    def __init__(self, name: str = "shoal") -> None:
        self.name = name
        self._group = asyncio.TaskGroup()
        self._actors: list[Actor[Any]] = []
        self._runs: dict[int, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        for task in self._tasks:
            task.cancel()
        if exc_type is None:
            try:
                await self._stop_in_order()
            except asyncio.CancelledError as cancelled:
                # A child failed (the task group cancels its parent: us) or we were cancelled:
                # stop the rest at once and let the group's exit raise what happened.
                self.stop_all()
                await self._group.__aexit__(type(cancelled), cancelled, cancelled.__traceback__)
                return None
        else:
            self.stop_all()
        await self._group.__aexit__(exc_type, exc, tb)
        return None

    async def _stop_in_order(self) -> None:
        stopped: set[int] = set()
        while True:
            # Re-read the list each time: an actor finishing its mailbox may spawn another.
            for task in self._tasks:
                # Daemon loops started since (an actor may still start one). Once only: a
                # second cancel would cut short a loop's own clean-up (closing its clients).
                if not task.cancelling():
                    task.cancel()
            rest = [a for a in self._actors if id(a) not in stopped]
            if not rest:
                return
            actor = rest[-1]
            stopped.add(id(actor))
            actor.stop()
            run = self._runs.get(id(actor))
            if run is not None:
                # Not raising here: a failed actor's error reaches the task group's exit.
                await asyncio.wait({run})

    async def spawn(self, actor: Actor[Any]) -> Actor[Any]:
        """Start ``actor`` and wait until its ``on_start`` has run."""
        self._actors.append(actor)
        task = self._group.create_task(actor.run(), name=f"actor:{actor.name}")
        self._runs[id(actor)] = task
        started = asyncio.ensure_future(actor.started.wait())
        try:
            await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()  # a helper waiter of ours; nothing to collect from it
        if task.done() and not actor.started.is_set():
            task.result()  # raises what on_start raised
        return actor

    def start_soon(
        self, coro: Coroutine[Any, Any, None], name: str, *, daemon: bool = True
    ) -> asyncio.Task[None]:
        """Run a helper loop under this supervisor. ``daemon`` loops are cancelled when the
        supervisor exits; others are awaited."""
        task = self._group.create_task(coro, name=name)
        if daemon:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return task

    def stop_all(self) -> None:
        for actor in reversed(self._actors):
            actor.stop()

    def statistics(self) -> list[MailboxStats]:
        return [a.statistics() for a in self._actors]
