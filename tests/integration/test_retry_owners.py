"""Several owners of one RQ/DLQ (``RetryQueue(driver=...)``) against the embedded broker: every
owner sends its own new records and parks them; only the driver sends the RQ's records; a new
reader sees what the previous owner parked (the barrier); the driver role moves, also away from
a queue that died; every record is delivered, each key in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack

import pytest

from protocol.retry import RetryPolicy
from runtime.kafka import KafkaConfig
from runtime.kafka.retry_queue import (
    PendingSend,
    RetryQueue,
    RetryQueueConfig,
    internal_topic,
    ordering_key,
)
from tests.fixtures.kafka import connector, kafka_broker, kafka_config

__all__ = ["connector", "kafka_broker", "kafka_config"]  # fixtures used by name

FAST = RetryPolicy(max_attempts=50, base_backoff=0.02, max_backoff=0.1, jitter=0.0)


class Owner:
    """One owner: its queue, whether it may drive, and what it sent (name, record, attempts)."""

    def __init__(
        self,
        name: str,
        kafka: KafkaConfig,
        config: RetryQueueConfig,
        sent: list[tuple[str, str, int]],
        fails: Callable[[str, int], bool],
    ) -> None:
        self.name = name
        self.drive = False
        self.sent = sent
        self.fails = fails
        self.queue = RetryQueue(
            kafka,
            config,
            self._send,
            name=name,
            driver=lambda: self.drive,
            takeover_grace_s=0.2,
            steer_interval_s=0.05,
        )

    async def _send(self, p: PendingSend) -> None:
        self.sent.append((self.name, p.record_id, p.attempts))
        loop = asyncio.get_running_loop()
        if self.fails(p.key, p.attempts):
            loop.call_soon(self.queue.failed, p.record_id, "injected")
        else:
            loop.call_soon(self.queue.delivered, p.record_id)


def key(k: int) -> str:
    return ordering_key("T", f'{{"id": "{k}"}}')


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def delivered_order(sent: list[tuple[str, str, int]], failures: set[tuple[str, int]]) -> list[str]:
    """Record ids in the order they were delivered (sends that did not fail), first copy only."""
    out: list[str] = []
    for _, rid, attempts in sent:
        if (rid, attempts) not in failures and rid not in out:
            out.append(rid)
    return out


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_two_owners_share_one_rq_only_the_driver_retries_and_order_holds(
    kafka_config: KafkaConfig, connector: str
) -> None:
    config = RetryQueueConfig(
        rq=internal_topic(f"{connector}_rq", 2),
        dlq=internal_topic(f"{connector}_dlq", 2),
        policy=FAST,
    )
    sent: list[tuple[str, str, int]] = []
    failures: set[tuple[str, int]] = set()
    bad = {key(1): 3}  # key 1 fails its first 3 attempts of each record

    def fails(k: str, attempts: int) -> bool:
        return attempts < bad.get(k, 0)

    a = Owner("A", kafka_config, config, sent, fails)
    b = Owner("B", kafka_config, config, sent, fails)

    def note_failures() -> None:
        for _, rid, attempts in sent:
            if fails(key_of_rid[rid], attempts):
                failures.add((rid, attempts))

    key_of_rid: dict[str, str] = {}

    def records(owner: str, n: int, keys: range) -> list[tuple[str, str, bytes]]:
        out = []
        for i in range(n):
            for k in keys:
                rid = f"{owner}-{k}-{i}"
                key_of_rid[rid] = key(k)
                out.append((rid, key(k), rid.encode()))
        return out

    async with AsyncExitStack() as stack:
        a.drive = True
        await stack.enter_async_context(a.queue)
        await stack.enter_async_context(b.queue)
        await until(lambda: a.queue.driving)
        assert not b.queue.driving

        # B reads keys 0..2: key 1 fails, B parks its records; A, the driver, retries them.
        first = records("B", 3, range(3))
        settled = await b.queue.submit(first)
        await asyncio.wait_for(settled, 20)
        await until(lambda: not a.queue.core.holds("B-1-2") and not b.queue.core.holds("B-1-2"))
        retried_by = {name for name, rid, attempts in sent if attempts > 0}
        assert retried_by == {"A"}, f"the RQ was sent by {retried_by}"
        assert b.queue.statistics().records_delivered == 6  # keys 0 and 2, directly

        # Key 1's partition moves to A while B still has its records parked (B drives: A's
        # queue must not send key 1's new record before them, although A never saw them fail).
        a.drive, b.drive = False, True
        await until(lambda: b.queue.driving and not a.queue.driving)
        bad[key(1)] = 100  # key 1 keeps failing: its records stay parked
        key_of_rid["B-1-p0"] = key(1)
        await asyncio.wait_for(await b.queue.submit([("B-1-p0", key(1), b"p0")]), 20)
        barriers = a.queue.statistics().barriers
        await a.queue.barrier()  # what a new reader does before it delivers anything
        assert a.queue.statistics().barriers == barriers + 1
        assert a.queue.blocks(key(1))
        later = [("A-1-later", key(1), b"later")]
        key_of_rid["A-1-later"] = key(1)
        await asyncio.wait_for(await a.queue.submit(later), 20)  # parked, not sent
        assert not [s for s in sent if s[1] == "A-1-later"]
        bad[key(1)] = 0
        await until(lambda: any(s[1] == "A-1-later" for s in sent))

        # The driver dies with records in the RQ: the other owner takes over and sends them.
        bad[key(1)] = 100
        more = records("A", 2, range(1, 2))
        await asyncio.wait_for(await a.queue.submit(more), 20)
        a.drive, b.drive = True, False
        await until(lambda: a.queue.driving and not b.queue.driving)
        await asyncio.sleep(0.3)  # A retries (and fails) a few times
        await a.queue.abort()
        bad[key(1)] = 0
        b.drive = True
        await until(lambda: all(any(s[1] == rid for s in sent) for rid, _, _ in more))
        await until(lambda: not b.queue.core.holds(more[-1][0]))
        note_failures()

    order = delivered_order(sent, failures)
    every = set(key_of_rid)
    assert set(order) == every, f"not delivered: {every - set(order)}"
    for k in (0, 2):
        assert [rid for rid in order if key_of_rid[rid] == key(k)] == [
            f"B-{k}-{i}" for i in range(3)
        ]
    # key 1, in the order the records were first handed to any queue
    k1 = [rid for rid in order if key_of_rid[rid] == key(1)]
    assert k1 == ["B-1-0", "B-1-1", "B-1-2", "B-1-p0", "A-1-later", "A-1-0", "A-1-1"]


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_queue_reading_park_release_park_of_one_record_keeps_its_payload(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """A record parked, delivered (Released), then handed over again and parked again behind
    its key: a queue that starts later reads the three entries in one go. It must hold the
    record with its payload (the payload of the first park was dropped with the Released) and
    deliver it."""
    config = RetryQueueConfig(
        rq=internal_topic(f"{connector}_rq", 1),
        dlq=internal_topic(f"{connector}_dlq", 1),
        policy=FAST,
    )
    sent: list[tuple[str, str, int]] = []
    down = {key(1)}

    def fails(k: str, attempts: int) -> bool:
        return k in down

    a = Owner("A", kafka_config, config, sent, fails)
    a.drive = True
    async with a.queue:
        await until(lambda: a.queue.driving)
        await asyncio.wait_for(await a.queue.submit([("r", key(1), b"payload-r")]), 20)
        down.clear()
        await until(lambda: not a.queue.core.holds("r"))  # delivered from the RQ: Released
        down.add(key(1))
        await asyncio.wait_for(await a.queue.submit([("s", key(1), b"payload-s")]), 20)
        await asyncio.wait_for(await a.queue.submit([("r", key(1), b"payload-r")]), 20)
        assert a.queue.core.group_state(key(1)).rq == ("s", "r")  # r parked again, behind s
        a.drive = False
        await until(lambda: not a.queue.driving)
    c_sent: list[tuple[str, str, int]] = []
    c = Owner("C", kafka_config, config, c_sent, fails)
    payloads: dict[str, bytes] = {}

    async def send(p: PendingSend) -> None:
        payloads[p.record_id] = p.payload
        await Owner._send(c, p)

    c.queue._send = send
    down.clear()
    c.drive = True
    async with c.queue:
        assert c.queue.core.group_state(key(1)).rq == ("s", "r")
        await until(lambda: not c.queue.core.holds("r"))
    assert [rid for _, rid, _ in c_sent] == ["s", "r"]
    assert payloads == {"s": b"payload-s", "r": b"payload-r"}


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_undecodable_rq_message_stops_a_shared_queue_loudly(
    kafka_config: KafkaConfig, connector: str
) -> None:
    """Skipping an RQ message could lose a parked record: the queue fails with an error that
    names the topic and offset, and closes (no hang, no leaked task)."""
    from runtime.kafka.retry_queue import make_producer

    config = RetryQueueConfig(
        rq=internal_topic(f"{connector}_rq", 1),
        dlq=internal_topic(f"{connector}_dlq", 1),
        policy=FAST,
    )
    owner = Owner("A", kafka_config, config, [], lambda k, a: False)
    producer = make_producer(kafka_config)
    await producer.start()
    try:
        # while it runs
        with pytest.raises(BaseExceptionGroup) as running:
            async with owner.queue:
                await producer.send_and_wait(f"{connector}_rq", b"\xc1 junk", partition=0)
                await asyncio.sleep(5)
        assert "undecodable message in" in str(running.value.exceptions[0])
        assert owner.queue._producer is None
    finally:
        await producer.stop()
    # at start
    again = Owner("B", kafka_config, config, [], lambda k, a: False)
    with pytest.raises(BaseExceptionGroup) as caught:
        async with again.queue:
            await asyncio.sleep(5)
    (error,) = caught.value.exceptions
    assert "undecodable message in" in str(error)
    assert f"{connector}_rq[0] at offset" in str(error)
    assert again.queue._producer is None  # closed


@pytest.mark.kafka
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_dlq_replay_via_the_running_driver(kafka_config: KafkaConfig, connector: str) -> None:
    """``dlq replay --via-leader``: the records go back to the RQ from a helper that sends
    nothing; the running driver delivers them, with the records parked behind; the helper
    returns once it has seen them delivered. With no driver it says so after its timeout."""
    from runtime.kafka.retry_queue import RetryQueueError, replay_via_driver

    config = RetryQueueConfig(
        rq=internal_topic(f"{connector}_rq", 2),
        dlq=internal_topic(f"{connector}_dlq", 2),
        policy=RetryPolicy(max_attempts=2, base_backoff=0.02, max_backoff=0.05, jitter=0.0),
    )
    sent: list[tuple[str, str, int]] = []
    down = {key(7)}
    a = Owner("A", kafka_config, config, sent, lambda k, attempts: k in down)
    a.drive = True
    async with a.queue:
        await until(lambda: a.queue.driving)
        records = [("d1", key(7), b"1"), ("d2", key(7), b"2"), ("ok", key(8), b"3")]
        await asyncio.wait_for(await a.queue.submit(records), 20)
        await until(lambda: len(a.queue.core.dlq_records()) == 1)  # d1 dead, d2 behind it
        assert a.queue.core.group_state(key(7)).rq == ("d2",)
        a.drive = False
        await until(lambda: not a.queue.driving)
        with pytest.raises(RetryQueueError, match="is a shoal process over these topics"):
            await replay_via_driver(kafka_config, config, timeout_s=1.5)  # nobody drives
        down.clear()
        a.drive = True
        await until(lambda: a.queue.driving)
        # the helper's replay of 1.5 s ago is in the RQ already: A delivers it
        await until(lambda: not a.queue.core.holds("d2"))
        assert [rid for _, rid, _ in sent if rid.startswith("d")][-2:] == ["d1", "d2"]
        # one more round through the helper, while A drives
        down.add(key(7))
        await asyncio.wait_for(await a.queue.submit([("d3", key(7), b"4")]), 20)
        await until(lambda: len(a.queue.core.dlq_records()) == 1)
        down.clear()
        replayed = await replay_via_driver(kafka_config, config, timeout_s=20)
        assert replayed == ["d3"]
        assert not a.queue.core.holds("d3")
        assert sent[-1][1] == "d3"
