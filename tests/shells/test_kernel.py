"""The actor kernel: bounded mailboxes, tell/ask, lifecycle, failures that propagate."""

from __future__ import annotations

import asyncio

import pytest

from actors.kernel import Actor, ActorDead, MailboxFull, Supervisor


class Echo(Actor[object]):
    def __init__(self, capacity: int = 2) -> None:
        super().__init__("echo", capacity)
        self.seen: list[object] = []
        self.stopped = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def receive(self, message: object) -> object:
        await self.gate.wait()
        if message == "boom":
            raise ValueError("boom")
        self.seen.append(message)
        return ("echo", message)

    async def on_stop(self) -> None:
        self.stopped = True


@pytest.mark.asyncio
async def test_tell_and_ask_in_order() -> None:
    async with Supervisor() as sup:
        echo = Echo(capacity=8)
        await sup.spawn(echo)
        await echo.tell(1)
        assert await echo.ask(2, timeout=1) == ("echo", 2)
        assert echo.seen == [1, 2]
    assert echo.stopped
    assert not echo.alive


@pytest.mark.asyncio
async def test_bounded_mailbox_pushes_back() -> None:
    async with Supervisor() as sup:
        echo = Echo(capacity=2)
        echo.gate.clear()
        await sup.spawn(echo)
        echo.tell_nowait(1)  # taken by the loop, blocked in receive
        await asyncio.sleep(0)
        echo.tell_nowait(2)
        echo.tell_nowait(3)
        with pytest.raises(MailboxFull):
            echo.tell_nowait(4)
        blocked = asyncio.ensure_future(echo.tell(4))
        await asyncio.sleep(0.01)
        assert not blocked.done()  # backpressure: tell waits for room
        echo.gate.set()
        await asyncio.wait_for(blocked, 1)
        assert await echo.ask(5, timeout=1) == ("echo", 5)
        assert echo.seen == [1, 2, 3, 4, 5]


@pytest.mark.asyncio
async def test_stop_fails_pending_asks_and_later_sends() -> None:
    async with Supervisor() as sup:
        echo = Echo(capacity=8)
        echo.gate.clear()
        await sup.spawn(echo)
        first = asyncio.ensure_future(echo.ask("first"))
        await asyncio.sleep(0)
        echo.stop()
        # Queued behind the stop: never handled.
        late = asyncio.ensure_future(echo.ask("late"))
        await asyncio.sleep(0)
        echo.gate.set()
        assert await first == ("echo", "first")
        with pytest.raises(ActorDead, match="echo"):
            await late
        with pytest.raises(ActorDead):
            await echo.tell("after")


@pytest.mark.asyncio
async def test_a_failure_reaches_the_asker_and_the_supervisor() -> None:
    with pytest.raises(ExceptionGroup) as info:
        async with Supervisor() as sup:
            echo = Echo(capacity=8)
            await sup.spawn(echo)
            with pytest.raises(ValueError, match="boom"):
                await echo.ask("boom", timeout=1)
            await asyncio.sleep(1)  # the group cancels this block
    assert info.group_contains(ValueError)
    assert echo.stopped


class Forwarder(Actor[object]):
    """Tells every message on to ``target``, an actor started before it (its dependency)."""

    def __init__(self, target: Echo) -> None:
        super().__init__("forwarder", capacity=8)
        self.target = target
        self.gate = asyncio.Event()

    async def receive(self, message: object) -> None:
        await self.gate.wait()
        await self.target.tell(message)


@pytest.mark.asyncio
async def test_leaving_stops_dependents_before_what_they_tell() -> None:
    # The race of a node's shutdown: the negotiator still had a tick queued when every actor got
    # its stop at once; the task actor finished first and the tick's tell raised ActorDead.
    async with Supervisor() as sup:
        echo = Echo(capacity=8)
        await sup.spawn(echo)
        forwarder = Forwarder(echo)
        await sup.spawn(forwarder)
        await forwarder.tell("queued")
        asyncio.get_running_loop().call_later(0.05, forwarder.gate.set)
    assert echo.seen == ["queued"]
    assert not echo.alive
    assert not forwarder.alive


@pytest.mark.asyncio
async def test_an_actor_spawned_while_leaving_is_stopped_too() -> None:
    late: list[Echo] = []

    class Spawner(Actor[object]):
        async def receive(self, message: object) -> None:
            child = Echo()
            late.append(child)
            await sup.spawn(child)

    async with Supervisor() as sup:
        spawner = Spawner("spawner")
        await sup.spawn(spawner)
        await spawner.tell("spawn one")  # handled after the stop is sent, before it is read
    assert late
    assert late[0].stopped


@pytest.mark.asyncio
async def test_a_failure_while_leaving_in_order_reaches_the_caller() -> None:
    # While the supervisor waits for one actor to stop, another fails: the task group cancels
    # the waiting exit; the failure must come out of it, not a bare CancelledError.
    class Slow(Actor[object]):
        async def receive(self, message: object) -> None:
            await asyncio.sleep(0.2)

    with pytest.raises(ExceptionGroup) as info:
        async with Supervisor() as sup:
            echo = Echo(capacity=8)
            await sup.spawn(echo)
            slow = Slow("slow")
            await sup.spawn(slow)
            await slow.tell("busy")  # stopping waits for this
            await echo.tell("boom")  # fails while the exit waits for `slow`
    assert info.group_contains(ValueError)


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_a_daemon_loop_started_while_leaving_is_cancelled() -> None:
    # A task actor handling its last messages may start a reader loop: leaving must not wait
    # for it forever.
    started: list[asyncio.Task[None]] = []

    async def forever() -> None:
        await asyncio.Event().wait()

    class Starter(Actor[object]):
        async def receive(self, message: object) -> None:
            started.append(sup.start_soon(forever(), name="late loop", daemon=True))

    async with Supervisor() as sup:
        starter = Starter("starter")
        await sup.spawn(starter)
        await starter.tell("start one")  # handled while the supervisor stops it
    assert started
    assert started[0].cancelled()
