"""The retry core (docs/design.md#retry-and-dead-letter-queues): exact command lists for given events, then a model-based
stateful test (per-key order, one in flight per key, every record delivered or dead-lettered
exactly once, the state rebuilt from the RQ/DLQ log at any point)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protocol.retry import (
    Command,
    Deliver,
    DeliveryFailed,
    DeliveryOk,
    DiscardDlq,
    Discarded,
    Drive,
    DriverElection,
    Duplicate,
    Event,
    GroupState,
    LogEntry,
    Observe,
    ParkInRetry,
    Released,
    ReplayDlq,
    RetryCore,
    RetryPolicy,
    RetryProtocolError,
    SendToDlq,
    SendToSink,
    SteerStep,
    Tick,
    decode_entry,
    encode_entry,
    from_log,
    may_drive,
)

FIXED = RetryPolicy(max_attempts=3, base_backoff=1.0, max_backoff=10.0, jitter=0.0)


def test_keys_flow_independently_one_in_flight_per_key() -> None:
    core = RetryCore(FIXED)
    assert core.handle(Deliver("a", "k1"), 0) == [SendToSink("a", "k1", 0)]
    assert core.handle(Deliver("b", "k1"), 0) == []  # waits behind a
    assert core.handle(Deliver("c", "k2"), 0) == [SendToSink("c", "k2", 0)]
    assert core.group_state("k1") == GroupState("k1", "a", (), (), ("b",))
    assert core.handle(DeliveryOk("a"), 1) == [SendToSink("b", "k1", 0)]
    assert core.handle(DeliveryOk("b"), 1) == []
    assert core.handle(DeliveryOk("c"), 1) == []
    assert core.statistics().held == 0
    core.validate()


def test_failure_parks_the_key_behind_it_in_the_rq() -> None:
    core = RetryCore(FIXED)
    assert core.handle(Deliver("a", "k"), 10) == [SendToSink("a", "k", 0)]  # seq 1
    assert core.handle(Deliver("b", "k"), 10) == []  # seq 2, waiting in memory
    assert core.handle(Deliver("x", "other"), 10) == [SendToSink("x", "other", 0)]  # seq 3
    assert core.handle(DeliveryFailed("a", "boom"), 10) == [
        ParkInRetry("a", "k", seq=1, version=4, attempts=1, due=11.0, error="boom"),
        ParkInRetry("b", "k", seq=2, version=5, attempts=0, due=10.0),
    ]
    assert core.handle(Deliver("c", "k"), 10.5) == [
        ParkInRetry("c", "k", seq=6, version=7, attempts=0, due=10.5)
    ]
    assert core.handle(DeliveryOk("x"), 10.5) == []  # other keys flow on
    assert core.handle(Tick(), 10.9) == []
    assert core.next_deadline() == 11.0
    assert core.handle(Tick(), 11) == [SendToSink("a", "k", 1)]
    assert core.handle(DeliveryOk("a"), 11.1) == [Released("a", "k", 8), SendToSink("b", "k", 0)]
    assert core.handle(DeliveryOk("b"), 11.2) == [Released("b", "k", 9), SendToSink("c", "k", 0)]
    assert core.handle(DeliveryOk("c"), 11.3) == [Released("c", "k", 10)]
    assert core.group_state("k") == GroupState("k", None, (), (), ())
    core.validate()


def test_blocks_says_which_keys_must_go_through_the_core() -> None:
    """A sink that delivers most records itself (the Spark bridge) asks ``blocks(key)``."""
    core = RetryCore(FIXED)
    assert not core.blocks("k")
    core.handle(Deliver("a", "k"), 0)
    assert core.blocks("k")  # in flight
    core.handle(Deliver("b", "k"), 0)
    core.handle(DeliveryFailed("a", "boom"), 0)
    assert core.blocks("k")  # in the RQ
    assert core.held_count() == 2
    core.handle(Tick(), 1)
    core.handle(DeliveryOk("a"), 1)
    core.handle(DeliveryOk("b"), 1)
    assert not core.blocks("k")
    release = RetryCore(RetryPolicy(max_attempts=1, dlq_blocks=False))
    release.handle(Deliver("c", "j"), 0)
    release.handle(DeliveryFailed("c", "boom"), 0)
    assert not release.blocks("j")  # only a DLQ record, and the DLQ releases
    assert release.held_count() == 1
    core.validate()
    release.validate()


def test_backoff_doubles_then_dead_letters_and_blocks() -> None:
    core = RetryCore(FIXED)
    core.handle(Deliver("a", "k"), 0)
    assert core.handle(DeliveryFailed("a", "e1"), 0) == [ParkInRetry("a", "k", 1, 2, 1, 1.0, "e1")]
    assert core.handle(Deliver("b", "k"), 0.5) == [ParkInRetry("b", "k", 3, 4, 0, 0.5)]
    assert core.handle(Tick(), 1) == [SendToSink("a", "k", 1)]
    assert core.handle(DeliveryFailed("a", "e2"), 1) == [ParkInRetry("a", "k", 1, 5, 2, 3.0, "e2")]
    assert core.handle(Tick(), 3) == [SendToSink("a", "k", 2)]
    assert core.handle(DeliveryFailed("a", "e3"), 3) == [SendToDlq("a", "k", 1, 6, 3, "e3")]
    # blocked: b stays parked, later records park too
    assert core.handle(Deliver("c", "k"), 4) == [ParkInRetry("c", "k", 7, 8, 0, 4.0)]
    assert core.handle(Tick(), 100) == []
    assert core.next_deadline() is None
    assert core.group_state("k") == GroupState("k", None, ("b", "c"), ("a",), ())
    core.validate()
    # replaying puts a back in front, by sequence number
    assert core.handle(ReplayDlq("a"), 100) == [
        ParkInRetry("a", "k", 1, 9, 0, 100.0, "e3"),
        SendToSink("a", "k", 0),
    ]
    assert core.handle(DeliveryOk("a"), 101) == [Released("a", "k", 10), SendToSink("b", "k", 0)]
    core.validate()


def test_release_mode_lets_the_key_flow_after_the_dlq() -> None:
    core = RetryCore(RetryPolicy(max_attempts=1, dlq_blocks=False))
    core.handle(Deliver("a", "k"), 0)
    assert core.handle(Deliver("b", "k"), 0) == []
    assert core.handle(DeliveryFailed("a", "bad"), 0) == [
        SendToDlq("a", "k", 1, 3, 1, "bad"),
        SendToSink("b", "k", 0),
    ]
    assert core.handle(Deliver("c", "k"), 0) == []  # behind b, in memory
    assert core.handle(DeliveryOk("b"), 0) == [SendToSink("c", "k", 0)]
    core.validate()
    assert core.handle(DiscardDlq("a"), 0) == [Discarded("a", "k", 5)]
    assert core.dlq_records() == []
    core.validate()


def test_duplicates_and_protocol_errors() -> None:
    core = RetryCore(FIXED)
    core.handle(Deliver("a", "k"), 0)
    assert core.handle(Deliver("a", "k"), 0) == [Duplicate("a")]
    with pytest.raises(RetryProtocolError, match="not in flight"):
        core.handle(DeliveryOk("zzz"), 0)
    with pytest.raises(RetryProtocolError, match="not in the DLQ"):
        core.handle(ReplayDlq("a"), 0)
    core.handle(DeliveryOk("a"), 0)
    with pytest.raises(RetryProtocolError, match="not in flight"):
        core.handle(DeliveryFailed("a", "late"), 0)
    assert core.statistics().duplicates == 1


def test_jitter_is_seeded() -> None:
    def dues(seed: int) -> list[float]:
        core = RetryCore(RetryPolicy(jitter=0.5), seed=seed)
        out = []
        for i in range(5):
            core.handle(Deliver(f"r{i}", f"k{i}"), 0)
            (cmd,) = core.handle(DeliveryFailed(f"r{i}", "x"), 0)
            assert isinstance(cmd, ParkInRetry)
            assert 0.1 <= cmd.due <= 0.15
            out.append(cmd.due)
        return out

    assert dues(1) == dues(1)
    assert dues(1) != dues(2)


def test_from_log_resumes_after_a_crash() -> None:
    core = RetryCore(FIXED)
    log: list[LogEntry] = []

    def run(ev: Event, now: float) -> list[Command]:
        cmds = core.handle(ev, now)
        log.extend(c for c in cmds if isinstance(c, ParkInRetry | Released | SendToDlq | Discarded))
        return cmds

    run(Deliver("a", "k"), 0)
    run(Deliver("b", "k"), 0)
    run(DeliveryFailed("a", "e"), 0)  # a (attempt 1, due 1), b parked
    run(Deliver("z", "dead"), 0)
    run(DeliveryFailed("z", "e"), 0)
    run(Tick(), 1)
    run(DeliveryFailed("z", "e"), 1)
    run(Tick(), 10)
    run(DeliveryFailed("z", "e"), 10)  # z in the DLQ
    # the log is read back in a different order (two topics): versions decide
    wire = [decode_entry(encode_entry(e)) for e in reversed(log)]
    new = from_log(wire, FIXED)
    new.validate()
    assert new.durable_state() == core.durable_state()
    assert new.group_state("k") == GroupState("k", None, ("a", "b"), (), ())
    assert [e.record_id for e in new.dlq_records()] == ["z"]
    # a is in flight in the old core; the new one sends it again (at least once)
    assert new.handle(Tick(), 10) == [SendToSink("a", "k", 1)]
    cmds = new.handle(Deliver("c", "k"), 10)
    (park,) = cmds
    assert isinstance(park, ParkInRetry)
    assert park.seq > max(e.version for e in log)  # numbering continues above the log
    assert new.handle(Deliver("b", "k"), 10) == [Duplicate("b")]  # upstream re-delivery


def test_stale_rq_entry_loses_to_a_newer_dlq_entry() -> None:
    entries: list[LogEntry] = [
        ParkInRetry("a", "k", 1, 2, 1, 5.0, "e"),
        SendToDlq("a", "k", 1, 3, 2, "e"),
        ParkInRetry("b", "k", 4, 5, 0, 6.0),
        Released("b", "k", 7),
        ParkInRetry("b", "k", 4, 6, 1, 7.0, "e"),
    ]
    core = from_log(entries, FIXED)
    core.validate()
    assert core.group_state("k") == GroupState("k", None, (), ("a",), ())


# --- model-based -------------------------------------------------------------------------------

KEYS = ("k1", "k2", "k3")


class RetryMachine(RuleBasedStateMachine):
    """Drives the core like the Kafka sink does, with a durable log and crashes."""

    dlq_blocks = True

    def __init__(self) -> None:
        super().__init__()
        self.policy = RetryPolicy(
            max_attempts=3,
            base_backoff=1.0,
            max_backoff=4.0,
            jitter=0.5,
            dlq_blocks=self.dlq_blocks,
        )
        self.core = RetryCore(self.policy, seed=7)
        self.now = 0.0
        self.n = 0
        self.log: list[LogEntry] = []  # the RQ and DLQ topics
        self.in_flight: dict[str, str] = {}  # record -> key, sent and not answered
        self.arrival: dict[str, list[str]] = {k: [] for k in KEYS}
        self.key_of: dict[str, str] = {}
        self.unsettled: dict[str, str] = {}  # upstream will re-deliver these after a crash
        self.delivered: list[str] = []
        self.ever_dlq: set[str] = set()

    def run(self, ev: Event) -> None:
        for c in self.core.handle(ev, self.now):
            match c:
                case SendToSink(record_id=rid, key=key):
                    assert key not in self.in_flight.values(), f"second record in flight for {key}"
                    self.in_flight[rid] = key
                case ParkInRetry() | SendToDlq():
                    self.log.append(c)
                    self.unsettled.pop(c.record_id, None)
                    if isinstance(c, SendToDlq):
                        self.ever_dlq.add(c.record_id)
                case Released() | Discarded():
                    self.log.append(c)
                case Duplicate():
                    pass

    @rule(key=st.sampled_from(KEYS))
    def deliver(self, key: str) -> None:
        rid = f"r{self.n}"
        self.n += 1
        self.arrival[key].append(rid)
        self.key_of[rid] = key
        self.unsettled[rid] = key
        self.run(Deliver(rid, key))

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data: st.DataObject, ok: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.in_flight)))
        del self.in_flight[rid]
        if ok:
            self.delivered.append(rid)
            self.unsettled.pop(rid, None)
            self.run(DeliveryOk(rid))
        else:
            self.run(DeliveryFailed(rid, "injected"))

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.run(Tick())

    @precondition(lambda self: bool(self.core.dlq_records()))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(e.record_id for e in self.core.dlq_records())))
        self.run(ReplayDlq(rid))

    @rule()
    def crash(self) -> None:
        """The task dies: in-flight and in-memory state is gone; a new core is built from the
        log, and upstream re-delivers what was never settled, in order."""
        self.core = from_log(self.log, self.policy, seed=8)
        self.in_flight.clear()
        for rid in sorted(self.unsettled, key=lambda r: int(r[1:])):
            self.run(Deliver(rid, self.unsettled[rid]))

    @invariant()
    def core_is_valid(self) -> None:
        self.core.validate()

    @invariant()
    def log_rebuilds_the_state(self) -> None:
        assert from_log(self.log, self.policy).durable_state() == self.core.durable_state()

    @invariant()
    def per_key_order(self) -> None:
        assert len(set(self.delivered)) == len(self.delivered), "a record delivered twice"
        for key in KEYS:
            got = [r for r in self.delivered if self.key_of[r] == key]
            if self.dlq_blocks:
                assert got == self.arrival[key][: len(got)], f"{key}: {got}"
            else:
                kept = [r for r in got if r not in self.ever_dlq]
                assert kept == [r for r in self.arrival[key] if r in set(kept)], f"{key}: {got}"

    def drain(self) -> None:
        for _ in range(10_000):
            if self.in_flight:
                rid = min(self.in_flight)
                del self.in_flight[rid]
                self.delivered.append(rid)
                self.unsettled.pop(rid, None)
                self.run(DeliveryOk(rid))
            elif self.core.next_deadline() is not None:
                self.now = max(self.now, self.core.next_deadline() or 0.0)
                self.run(Tick())
            else:
                return
        raise AssertionError("did not drain")

    def teardown(self) -> None:
        self.drain()
        self.per_key_order()
        dlq = {e.record_id for e in self.core.dlq_records()}
        rq = {e.record_id for e in self.core.durable_state() if isinstance(e, ParkInRetry)}
        everything = set(self.key_of)
        assert not (dlq & set(self.delivered))
        if not self.dlq_blocks:
            assert not rq, "records left in the RQ with nothing blocking them"
        # blocked keys keep their later records parked in the RQ behind the DLQ record
        assert all(self.key_of[r] in {self.key_of[d] for d in dlq} for r in rq)
        assert dlq | rq | set(self.delivered) == everything, "a record was lost"
        # replaying the DLQ delivers the rest
        for rid in sorted(dlq):
            self.run(ReplayDlq(rid))
        self.drain()
        assert sorted(self.delivered) == sorted(everything)
        assert self.core.statistics().held == 0
        self.per_key_order()


class ReleasingRetryMachine(RetryMachine):
    dlq_blocks = False


TestRetryMachine = RetryMachine.TestCase
TestRetryMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestReleasingRetryMachine = ReleasingRetryMachine.TestCase
TestReleasingRetryMachine.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None
)


# --- every state x event: a legal transition or a clear protocol error ---------------------------


def _state(name: str) -> tuple[RetryCore, str]:
    """A core with key ``k`` in state ``name`` and the id of the record that state is about."""
    core = RetryCore(FIXED)
    if name == "idle":
        return core, "a"
    core.handle(Deliver("a", "k"), 0)
    if name == "in-flight":
        return core, "a"
    core.handle(DeliveryFailed("a", "e"), 0)
    if name == "rq-waiting":
        return core, "a"
    core.handle(Tick(), 1)
    if name == "rq-in-flight":
        return core, "a"
    core.handle(DeliveryFailed("a", "e"), 1)
    core.handle(Tick(), 10)
    core.handle(DeliveryFailed("a", "e"), 10)
    assert name == "dead-lettered"
    return core, "a"


STATES = ("idle", "in-flight", "rq-waiting", "rq-in-flight", "dead-lettered")
LEGAL = {
    ("idle", "deliver"),
    ("idle", "tick"),
    ("in-flight", "deliver"),
    ("in-flight", "ok"),
    ("in-flight", "failed"),
    ("in-flight", "tick"),
    ("rq-waiting", "deliver"),
    ("rq-waiting", "tick"),
    ("rq-in-flight", "deliver"),
    ("rq-in-flight", "ok"),
    ("rq-in-flight", "failed"),
    ("rq-in-flight", "tick"),
    ("dead-lettered", "deliver"),
    ("dead-lettered", "tick"),
    ("dead-lettered", "replay"),
    ("dead-lettered", "discard"),
}


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("kind", ["deliver", "ok", "failed", "tick", "replay", "discard"])
def test_every_state_and_event(state: str, kind: str) -> None:
    core, rid = _state(state)
    event: Event = {
        "deliver": Deliver("b", "k"),
        "ok": DeliveryOk(rid),
        "failed": DeliveryFailed(rid, "x"),
        "tick": Tick(),
        "replay": ReplayDlq(rid),
        "discard": DiscardDlq(rid),
    }[kind]
    if (state, kind) in LEGAL:
        core.handle(event, 20)
    else:
        with pytest.raises(RetryProtocolError):
            core.handle(event, 20)
    core.validate()


# --- several owners over one RQ/DLQ ------------------------------------------------------------


class SharedRetryMachine(RuleBasedStateMachine):
    """Two owners share one RQ/DLQ log, each reading it with its own delay. Each key is read by
    one owner at a time (its change-stream partition's owner) and moves between them with a
    drained hand-off, after which the new reader has read the log to its end (the barrier). One
    owner at a time drives the RQ; a switch waits until the old driver's RQ sends answered and
    the new one has read the whole log. Whatever interleaving: per key, records arrive in
    order, one in flight at a time over both owners, each exactly once."""

    OWNERS = ("A", "B")

    def __init__(self) -> None:
        super().__init__()
        self.policy = RetryPolicy(max_attempts=3, base_backoff=1.0, max_backoff=4.0, jitter=0.0)
        self.cores = {
            o: RetryCore(self.policy, seed=i, shared=True) for i, o in enumerate(self.OWNERS)
        }
        self.cores["B"].handle(Drive(False), 0.0)
        self.driver = "A"
        # the RQ topic (parks, releases) and the DLQ topic (dead letters, discards): each owner
        # reads each at its own pace, so a record's entries may arrive out of version order
        self.logs: dict[str, list[LogEntry]] = {"rq": [], "dlq": []}
        self.read_to = {(o, t): 0 for o in self.OWNERS for t in self.logs}
        self.barriers: dict[str, tuple[int, dict[str, int]]] = {}
        self.reader = dict.fromkeys(KEYS, "A")  # who reads each key's partition
        self.in_flight: dict[str, tuple[str, str, bool]] = {}  # rid -> (owner, key, from rq)
        self.arrival: dict[str, list[str]] = {k: [] for k in KEYS}
        self.key_of: dict[str, str] = {}
        self.delivered: list[str] = []
        self.now = 0.0
        self.n = 0

    def run(self, owner: str, event: Event) -> None:
        for c in self.cores[owner].handle(event, self.now):
            match c:
                case SendToSink(record_id=rid, key=key, attempts=attempts):
                    busy = [r for r, (_, k, _) in self.in_flight.items() if k == key]
                    assert not busy, f"{key}: {rid} sent by {owner} while {busy} in flight"
                    self.in_flight[rid] = (owner, key, attempts > 0 or self._parked(rid))
                case ParkInRetry() | SendToDlq() | Released() | Discarded():
                    topic = "rq" if isinstance(c, ParkInRetry | Released) else "dlq"
                    self.logs[topic].append(c)
                case Duplicate():
                    raise AssertionError(f"duplicate {c} at {owner}")

    def _parked(self, rid: str) -> bool:
        return any(isinstance(e, ParkInRetry) and e.record_id == rid for e in self.logs["rq"])

    def read_log(self, owner: str, steps: int | None = None, topic: str | None = None) -> None:
        """Read ``steps`` more entries of one topic, or (a barrier) both topics to their end."""
        for t in self.logs if topic is None else (topic,):
            log = self.logs[t]
            end = len(log) if steps is None else min(self.read_to[owner, t] + steps, len(log))
            while self.read_to[owner, t] < end:
                entry = log[self.read_to[owner, t]]
                self.read_to[owner, t] += 1
                self.run(owner, Observe(entry))

    @rule(key=st.sampled_from(KEYS))
    def deliver(self, key: str) -> None:
        rid = f"r{self.n}"
        self.n += 1
        self.arrival[key].append(rid)
        self.key_of[rid] = key
        self.run(self.reader[key], Deliver(rid, key))

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data: st.DataObject, ok: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.in_flight)))
        owner, _, _ = self.in_flight.pop(rid)
        if ok:
            self.delivered.append(rid)
            self.run(owner, DeliveryOk(rid))
        else:
            self.run(owner, DeliveryFailed(rid, "injected"))

    @rule(
        owner=st.sampled_from(OWNERS), steps=st.integers(1, 4), topic=st.sampled_from(["rq", "dlq"])
    )
    def read(self, owner: str, steps: int, topic: str) -> None:
        self.read_log(owner, steps, topic)

    @rule(owner=st.sampled_from(OWNERS))
    def barrier_begins(self, owner: str) -> None:
        """A barrier's markers are written now (after this core's clock and each topic's end)."""
        ends = {t: len(log) for t, log in self.logs.items()}
        self.barriers[owner] = (self.cores[owner].clock, ends)

    @precondition(lambda self: bool(self.barriers))
    @rule(data=st.data())
    def barrier_completes(self, data: st.DataObject) -> None:
        """The markers are read back: everything before them is folded in; settled records'
        versions from before the barrier began are forgotten (others wrote meanwhile)."""
        owner = data.draw(st.sampled_from(sorted(self.barriers)))
        clock, ends = self.barriers.pop(owner)
        for topic, end in ends.items():
            self.read_log(owner, max(0, end - self.read_to[owner, topic]), topic)
        self.cores[owner].forget_settled(clock)

    @rule(dt=st.sampled_from([0.0, 1.0, 4.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        for owner in self.OWNERS:
            self.run(owner, Tick())

    @precondition(lambda self: bool(self.cores[self.driver].dlq_records()))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        dlq = self.cores[self.driver].dlq_records()
        rid = data.draw(st.sampled_from(sorted(e.record_id for e in dlq)))
        self.run(self.driver, ReplayDlq(rid))

    def _idle(self, owner: str, key: str | None = None) -> bool:
        core = self.cores[owner]
        keys = KEYS if key is None else (key,)
        return all(
            core.group_state(k).in_flight is None and not core.group_state(k).waiting for k in keys
        )

    @rule(key=st.sampled_from(KEYS))
    def move(self, key: str) -> None:
        """The key's partition moves to the other owner (a drained hand-off, then the barrier)."""
        old = self.reader[key]
        if not self._idle(old, key):
            return
        new = "B" if old == "A" else "A"
        self.read_log(new)
        self.reader[key] = new

    @rule()
    def switch_driver(self) -> None:
        old = self.driver
        if any(o == old and from_rq for o, _, from_rq in self.in_flight.values()):
            return  # fencing: the old driver's RQ sends are answered first
        new = "B" if old == "A" else "A"
        self.run(old, Drive(False))
        self.read_log(new)
        self.run(new, Drive(True))
        self.driver = new

    @invariant()
    def cores_are_valid(self) -> None:
        for core in self.cores.values():
            core.validate()

    @invariant()
    def per_key_order(self) -> None:
        assert len(set(self.delivered)) == len(self.delivered), "a record delivered twice"
        for key in KEYS:
            got = [r for r in self.delivered if self.key_of[r] == key]
            assert got == self.arrival[key][: len(got)], f"{key}: {got}"

    def teardown(self) -> None:
        for _ in range(10_000):
            if self.in_flight:
                rid = min(self.in_flight)
                owner, _, _ = self.in_flight.pop(rid)
                self.delivered.append(rid)
                self.run(owner, DeliveryOk(rid))
                continue
            if any(self.read_to[k] < len(self.logs[k[1]]) for k in self.read_to):
                for owner in self.OWNERS:
                    self.read_log(owner)
                continue
            dlq = self.cores[self.driver].dlq_records()
            if dlq:
                self.run(self.driver, ReplayDlq(dlq[0].record_id))
                continue
            deadline = self.cores[self.driver].next_deadline()
            if deadline is None:
                break
            self.now = max(self.now, deadline)
            self.run(self.driver, Tick())
        self.per_key_order()
        assert sorted(self.delivered) == sorted(self.key_of), "a record was lost"
        for core in self.cores.values():
            assert core.statistics().held == 0


TestSharedRetryMachine = SharedRetryMachine.TestCase
TestSharedRetryMachine.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)


def test_a_late_failure_at_the_old_driver_does_not_park_what_the_new_one_delivered() -> None:
    """The old driver's send outlived the take-over grace: the new driver delivered the record
    (Released) meanwhile; the old send then fails. The record must not be parked again (it
    would be delivered once more, after its key's later records)."""
    a = RetryCore(FIXED, shared=True)
    b = RetryCore(FIXED, shared=True)
    b.handle(Drive(False), 0)
    log: list[LogEntry] = []

    def entries(cmds: list[Command]) -> list[LogEntry]:
        out = [c for c in cmds if isinstance(c, ParkInRetry | Released | SendToDlq | Discarded)]
        log.extend(out)
        return out

    a.handle(Deliver("r", "k"), 0)
    entries(a.handle(DeliveryFailed("r", "e"), 0))  # parked by A
    assert a.handle(Tick(), 1) == [SendToSink("r", "k", 1)]  # A sends it from the RQ ...
    a.handle(Drive(False), 1)  # ... and loses the driver role while the send is in flight
    for e in log:
        b.handle(Observe(e), 1)
    assert b.handle(Drive(True), 11) == [SendToSink("r", "k", 1)]
    (released,) = entries(b.handle(DeliveryOk("r"), 11))
    assert isinstance(released, Released)
    assert a.handle(Observe(released), 11) == []  # deferred: A's send is still in flight
    assert a.handle(DeliveryFailed("r", "late"), 12) == []  # nothing parked again
    assert not a.holds("r")
    a.validate()
    assert a.handle(Observe(log[0]), 12) == []  # the old park read again changes nothing
    assert not a.holds("r")


def test_a_shared_core_forgets_settled_records_only_when_told() -> None:
    core = RetryCore(FIXED, shared=True)
    core.handle(Deliver("r", "k"), 0)
    core.handle(DeliveryFailed("r", "e"), 0)
    core.handle(Tick(), 1)
    core.handle(DeliveryOk("r"), 1)
    assert core.forget_settled(0) == 0  # settled after clock 0
    assert core.forget_settled(core.clock) == 1
    with pytest.raises(RetryProtocolError):
        RetryCore(FIXED).handle(Observe(Released("r", "k", 9)), 0)


def test_a_record_settled_after_a_barrier_began_stays_remembered() -> None:
    """The RQ and DLQ topics are read apart: a record parked (v1), dead-lettered (v2, DLQ),
    replayed (v3) and delivered (v4) may be seen as v1, v3, v4, then v2. Forgetting its version
    at a barrier that began before v4 would let the late v2 bring it back into the DLQ."""
    core = RetryCore(FIXED, shared=True)
    rq: list[LogEntry] = [
        ParkInRetry("r", "k", 1, 1, 1, 0.0, "e"),
        ParkInRetry("r", "k", 1, 3, 0, 0.0, ""),
        Released("r", "k", 4),
    ]
    dlq = SendToDlq("r", "k", 1, 2, 3, "e")
    core.handle(Drive(False), 0)
    for e in rq:
        core.handle(Observe(e), 0)
    assert not core.holds("r")
    assert core.forget_settled(2) == 0  # settled at 4: after the barrier began
    core.handle(Observe(dlq), 0)
    assert not core.holds("r"), "the late DLQ entry brought the record back"
    assert core.forget_settled(4) == 1


# --- the shared RQ's driver election -----------------------------------------------------------


def test_a_process_may_drive_only_through_a_task_that_leads_under_a_valid_lease() -> None:
    assert may_drive([("a", "a", True)])
    assert not may_drive([("a", "a", False)])  # the lease ran out
    assert not may_drive([("a", "b", True)])  # another task leads
    assert may_drive([("a", "b", True), ("b", "b", True)])  # one of its tasks leads
    assert not may_drive([])


def test_the_driver_takes_over_after_the_grace_and_a_catch_up_and_stops_at_once() -> None:
    e = DriverElection(grace_s=10.0)
    assert e.step(eligible=True, now=0.0) == SteerStep()
    assert e.step(eligible=True, now=9.9) == SteerStep()
    assert e.step(eligible=True, now=10.0) == SteerStep(catch_up=True)
    assert e.step(eligible=True, now=10.5) == SteerStep()  # one catch-up at a time
    assert e.caught_up(ok=True, eligible=True) is True
    assert e.driving
    assert e.step(eligible=True, now=11.0) == SteerStep()
    assert e.step(eligible=False, now=12.0) == SteerStep(stop=True)
    assert [e.driving] == [False]  # (a list: mypy keeps e.driving narrowed to True)
    assert e.step(eligible=False, now=13.0) == SteerStep()


def test_losing_eligibility_during_the_grace_or_the_catch_up_starts_the_grace_over() -> None:
    e = DriverElection(grace_s=10.0)
    e.step(eligible=True, now=0.0)
    e.step(eligible=False, now=5.0)
    assert e.step(eligible=True, now=12.0) == SteerStep()  # the grace starts again at 12
    assert e.step(eligible=True, now=22.0) == SteerStep(catch_up=True)
    assert e.caught_up(ok=True, eligible=False) is False  # it stopped leading meanwhile
    assert not e.driving
    assert e.step(eligible=True, now=23.0) == SteerStep()
    assert e.step(eligible=True, now=33.0) == SteerStep(catch_up=True)


def test_a_failed_catch_up_is_tried_again_at_the_next_step() -> None:
    e = DriverElection(grace_s=1.0)
    e.step(eligible=True, now=0.0)
    assert e.step(eligible=True, now=1.0) == SteerStep(catch_up=True)
    assert e.caught_up(ok=False, eligible=True) is False
    assert e.step(eligible=True, now=1.1) == SteerStep(catch_up=True)


def test_an_observer_that_reads_the_dlq_topic_ahead_of_the_rq_topic_stays_valid() -> None:
    """Found by the shared state machine: B (not driving) had read A's parks of r0 and r1 (one
    key) from the RQ topic, then A delivered r0 from the RQ and dead-lettered r1; B reads the
    DLQ topic ahead of the RQ topic, so it holds r1 in the DLQ while r0's release has not
    reached it yet. A view that lags between the two topics is legal for an observer (the
    driver catches up with both before it drives)."""
    policy = RetryPolicy(max_attempts=3, base_backoff=1.0, max_backoff=4.0, jitter=0.0)
    a = RetryCore(policy, seed=0, shared=True)
    b = RetryCore(policy, seed=1, shared=True)
    b.handle(Drive(False), 0.0)
    rq: list[LogEntry] = []
    dlq: list[LogEntry] = []
    sent: list[str] = []
    now = 0.0

    def run(event: Event) -> None:
        for c in a.handle(event, now):
            if isinstance(c, ParkInRetry | Released):
                rq.append(c)
            elif isinstance(c, SendToDlq | Discarded):
                dlq.append(c)
            elif isinstance(c, SendToSink):
                sent.append(c.record_id)

    run(Deliver("r0", "k"))
    run(DeliveryFailed("r0", "injected"))
    run(Deliver("r1", "k"))
    for entry in rq:
        b.handle(Observe(entry), now)
    read_rq = len(rq)
    sent.clear()  # r0's first send (failed above)
    for _ in range(20):  # A retries r0 (delivered), then r1 until it is dead-lettered
        now += 4.0
        run(Tick())
        while sent:
            rid = sent.pop(0)
            run(DeliveryOk(rid) if rid == "r0" else DeliveryFailed(rid, "injected"))
        if dlq:
            break
    assert [e.record_id for e in dlq] == ["r1"]
    b.handle(Observe(dlq[0]), now)
    b.validate()
    for entry in rq[read_rq:]:  # the RQ topic catches up: r0 is gone, r1 in the DLQ
        b.handle(Observe(entry), now)
    b.validate()
    assert [e.record_id for e in b.dlq_records()] == ["r1"]
    assert b.statistics().held == 1


def test_a_replay_does_not_park_records_ahead_of_one_in_flight_from_upstream() -> None:
    """Found by the releasing state machine: with dead letters releasing their key, r2 went
    straight to the sink and r3 waited behind it; replaying the dead-lettered r0 blocked the key
    and parked r3 in the RQ while r2, not durable, was still in flight. A crash then: upstream
    delivers r2 again, and it went behind r3. Now r3 stays behind r2 in memory until r2
    settles, so after a crash both come again from upstream, in order."""
    policy = RetryPolicy(
        max_attempts=1, base_backoff=1.0, max_backoff=1.0, jitter=0.0, dlq_blocks=False
    )
    core = RetryCore(policy, seed=1)
    log: list[LogEntry] = []

    def run(event: Event) -> list[Command]:
        out = core.handle(event, 0.0)
        log.extend(c for c in out if isinstance(c, ParkInRetry | Released | SendToDlq | Discarded))
        return out

    run(Deliver("r0", "k"))
    run(DeliveryFailed("r0", "injected"))  # dead-lettered at once; the key is not held
    assert run(Deliver("r2", "k")) == [SendToSink("r2", "k", 0)]
    assert run(Deliver("r3", "k")) == []  # waits behind r2
    replayed = run(ReplayDlq("r0"))
    assert [type(c).__name__ for c in replayed] == ["ParkInRetry"]  # r0 only, not r3
    core.validate()
    # the process dies here; a new core resumes from the log, upstream delivers r2, r3 again
    core = from_log(log, policy, seed=2)
    order: list[str] = []
    flying: list[str] = []

    def note(out: list[Command]) -> None:
        for c in out:
            if isinstance(c, SendToSink):
                order.append(c.record_id)
                flying.append(c.record_id)

    for rid in ("r2", "r3"):
        note(run(Deliver(rid, "k")))
    for _ in range(10):  # the sink takes everything now
        note(core.handle(Tick(), 10.0))
        while flying:
            note(run(DeliveryOk(flying.pop(0))))
    later = [r for r in order if r != "r0"]
    assert later.index("r2") < later.index("r3"), order


def test_waiting_records_are_parked_once_the_one_in_flight_from_upstream_is_delivered() -> None:
    policy = RetryPolicy(
        max_attempts=1, base_backoff=1.0, max_backoff=1.0, jitter=0.0, dlq_blocks=False
    )
    core = RetryCore(policy, seed=1)
    core.handle(Deliver("r0", "k"), 0.0)
    core.handle(DeliveryFailed("r0", "injected"), 0.0)
    core.handle(Deliver("r2", "k"), 0.0)
    core.handle(Deliver("r3", "k"), 0.0)
    core.handle(ReplayDlq("r0"), 0.0)
    out = core.handle(DeliveryOk("r2"), 0.0)
    assert [type(c).__name__ for c in out] == ["ParkInRetry", "SendToSink"]
    assert isinstance(out[0], ParkInRetry)
    assert out[0].record_id == "r3"
    assert out[1] == SendToSink("r0", "k", 0)
    core.validate()
