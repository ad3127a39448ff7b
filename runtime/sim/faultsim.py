"""The deterministic fault simulator: many tasks running the real protocol cores against
in-memory ports, a lossy and duplicating sync log, a group coordinator with generations and
session timeouts, crashes, restarts and zombies, a fake clock and a seeded change stream that
splits, moves and merges.

One seed fixes everything. Time advances in steps of ``step_us``; in each step every task, in a
seeded order, reads what has landed in the sync log, gets its group events, its readers' commits
and a tick, and its commands are carried out. Invariants are checked after every step:

* no partition is read by two tasks at once (a paused zombie does not read; when it resumes, its
  readers check the lease before every batch, as the real reader does, and stop);
* no two tasks that may read both own the same unfinished partition;
* a partition starts being read only after every parent has finished (merges: all parents);
* a watermark in the sync log never goes backwards;
* every task's own invariants (``TaskCore.validate``);
* no message storm: the tasks together append at most ``storm_limit`` messages per simulated
  second (a feedback loop of re-sends otherwise only shows as a run that never ends).

At the end, after a quiet period without faults and without partition churn:

* every live partition is owned by exactly one live task and is being read;
* owned counts are within one of each other across live tasks (when no cap binds);
* **exactly once**: every data record committed up to the horizon (5 s before the end) reached
  the sink; no record the sink committed, at any time, is one the stream never committed; and
  no record reached the sink twice, at any time (a record counts when the sink commits its
  batch).

With ``snapshot_partitions`` the connector starts with a snapshot (``protocol/snapshot.py``) at
T, one microsecond before the stream's roots: its partitions are dealt with the roots and read a
chunk or so per step, so kills, pauses and hand-offs fall in the middle of them. Their chunks
count in the exactly-once checks like the stream's records (each chunk reaches the sink exactly
once), every snapshot partition must be done at the end, and after every step the completeness
watermark of the log (``protocol/completeness.py``) is below T while a snapshot partition is not
done, and at or past T only once every chunk reached the sink.

Each simulated reader runs the real reader core (``protocol/reader.py``) against the model as
its source and a simulated sink that commits each batch after a delay, in order, or fails it
(``sink_fail_p``), and refuses the batches of a task whose lease ran out; a reader ending with
batches in flight fences them, counted in ``batches_fenced``. With ``ack_delay_steps`` a
committed batch's acknowledgement reaches its reader some steps after the commit point, so a
fence can find batches already past it (the fence race): they count as committed in the fence's
answer (``BatchesFenced.committed``, ``fence_committed``). The sink keeps each
partition's position atomically with every batch it commits; a crashed task's committed batches
stay committed, and a new owner starts from the newer of the sync log's and the sink's position
(a kill -9 between the sink's commit and the watermark's publication writes nothing twice).

The group coordinator follows the classic protocol's rules for removing members (K1-K4 of
``protocol/lease.py``): a heartbeat restarts a member's session and is answered
``REBALANCE_IN_PROGRESS`` while a rebalance is prepared, upon which the member sends its JoinGroup
and no heartbeat until it is answered; a JoinGroup reaches the coordinator after a delay or is
lost (``join_loss_p``; it then times out and is sent again); the join phase ends once every
member joined or the rebalance timeout passed, removing who did not join; followers wait for
the leader's SyncGroup without being expelled, and answering the SyncGroups restarts every
member's session (Kafka's ``propagateAssignment``); a removed member learns it only from the
answer to its next request. Each task's membership is the same pure core as the Kafka
adapter's (``protocol/membership.py``: the epochs it says, numbers and accepts, and the lease
over the send times of the requests answered), with broken rules in the teeth tests
(``SimParams.member_rules``).

With ``poison_at_us`` one partition turns poison (docs/design.md#poison-partitions): the first
of its records committed that long after the start fails every sink batch that holds it, as a
value the typed conversion cannot hold would. There is no partition churn then (a poison
partition never reaches its end, so its children would never be read). After every step: while
the log shows it quarantined (and not released) nobody reads it and the sink commits nothing of
it past its watermark. At the end: it was quarantined (``quarantine_after`` 0, the rule off, is
the teeth: it is retried for ever); with ``release_at_us`` the sink heals and a ``release``
message is appended at that time, and the partition must be read again from its watermark,
every record exactly once; without it, every record but the poison partition's from the poison
record on reached the sink.

With ``crash_loop_at_us`` one task is in a crash loop (docs/design.md#liveness-failover-and-health):
at that time the task owning the most partitions is killed; it comes back under its id
``crash_loop_restart_us`` later and joins first, so it leads the rebalance its return starts (on
Kafka the first member to join a rebalance leads it, and a restarted process joins first); it is
killed again ``crash_loop_life_us`` after the first epoch listing it lands, ``crash_loop_kills``
times in all. From that time on, after every step, no live partition's watermark in the log
stands still longer than ``unread_limit_us`` (-1: not checked): one fault's recovery bounds a
partition's unread time, however often the same task dies. ``SimResult.max_unread_us`` is the
longest such stretch.
With ``partition_mode="mutable"`` the stream is a ``MUTABLE_KEY_RANGE`` one
(``runtime/sim/mutable.py``, ``MutableStreamModel``): keys moving between live partitions,
partitions announced by others' partition start records and ending with partition end
records, the task cores and readers running the lifecycle of ``protocol/mutable.py``. Besides
the checks above, after every commit: **per-key timestamp order**, no write of a key reaches
the sink after a later write of that key did (a write is counted once, at its first commit).
``move_in_holds=False`` (the teeth) reads a held partition at once, passing its move-in.

``run(seed)`` returns a :class:`SimResult`; a failure names its seed so it can be replayed.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from random import Random

import msgspec

from protocol import messages
from protocol import snapshot as snapshots
from protocol.cim import Cim
from protocol.completeness import low_watermark
from protocol.dedup import Identity, PartitionTail, Position
from protocol.epochs import Logged
from protocol.events import Ids
from protocol.lease import LeaseTiming
from protocol.membership import (
    Assigned,
    HeartbeatAnswered,
    JoinAnswered,
    JoinFailed,
    JoinSent,
    LeaseUntil,
    MemberCommand,
    MemberCore,
    MemberRules,
    MembershipLost,
    Refuse,
    Said,
    SyncAnswered,
    Take,
)
from protocol.messages import (
    EpochMessage,
    Partition,
    SnapshotItem,
    SnapshotPlan,
    StateMessage,
    SyncMessage,
)
from protocol.mutable import PartitionEnd
from protocol.planner import Plan, plan
from protocol.reader import (
    BatchCommitted,
    BatchesFenced,
    BatchFailed,
    CancelQuery,
    Chunk,
    Done,
    FenceBatches,
    FlushBatches,
    PutBatch,
    QueryEnded,
    ReaderCommand,
    ReaderConfig,
    ReaderCore,
    ReaderRules,
    ReaderTick,
    Report,
    SourceRecord,
    Start,
    StartQuery,
    StopRequested,
)
from protocol.records import ChildPartitions, DataChange, Heartbeat, Mod
from protocol.task import (
    ANSWER_TIMEOUT,
    Alert,
    Joined,
    Joining,
    Lease,
    Lost,
    PartitionsAnnounced,
    PlanReady,
    Publish,
    PublishFailed,
    ReaderCommitted,
    ReaderFinished,
    ReadersCommitted,
    ReaderStopped,
    RequestPlan,
    Rules,
    StartReader,
    StopReader,
    SyncRead,
    TaskCommand,
    TaskConfig,
    TaskCore,
    TaskEvent,
    TaskTick,
    own_state_ts,
)
from runtime.sim.mutable import MutableStreamModel, MutableStreamParams, write_key
from runtime.sim.stream import StreamModel, StreamParams, snapshot_records

Planner = Callable[..., Plan]


class Violation(AssertionError):
    """An invariant of the protocol did not hold."""


class SimParams(msgspec.Struct, frozen=True):
    seed: int = 0
    tasks: int = 4
    max_tasks: int = 7
    roots: int = 6
    cap: int = 0
    step_us: int = 50_000
    churn_us: int = 40_000_000
    quiet_us: int = 30_000_000
    session_timeout_us: int = 3_000_000
    heartbeat_us: int = 1_000_000
    rebalance_delay_us: int = 1_000_000  # unused (the join phase times itself); kept for callers
    # the group coordinator's rebalance (join-phase) timeout and the lease margin
    # (protocol/lease.py); a JoinGroup reaches the coordinator after join_delay_steps, or is lost
    # with join_loss_p (the member's request times out after request_timeout_us and it sends
    # another; aiokafka sends no heartbeat meanwhile, the membership adapter does, on a second
    # connection, unless heartbeat_while_rebalancing is off)
    rebalance_timeout_us: int = 6_000_000
    lease_margin_us: int = 500_000
    # a follower's assignment reaches it up to this long after the leader's, drawn per follower
    # from its own random generator: the embedded broker answers followers' JoinGroups up to
    # seconds after the leader's, and a slow connection delays a SyncGroup's answer on any
    # Kafka. The leader may plan (answer timeout) and its epoch land first (protocol/epochs.py,
    # rule 5). (0, 0): every member gets it at once, as the seeds found before 2026-11 had.
    follower_lag_us: tuple[int, int] = (0, 2_000_000)
    join_delay_steps: tuple[int, int] = (0, 3)
    join_loss_p: float = 0.0
    request_timeout_us: int = 2_000_000
    # the membership adapter heartbeats on a second connection while its JoinGroup or SyncGroup
    # is in flight (runtime/kafka/membership.py); off: only aiokafka's heartbeats, as before
    heartbeat_while_rebalancing: bool = True
    # the leader's wait for rebalance answers: the shipped default (some regression and teeth
    # seeds were found with a shorter one, and run with it)
    answer_timeout_us: int = ANSWER_TIMEOUT
    crash_p: float = 0.004
    restart_p: float = 0.5  # a crashed task comes back under the same id
    join_p: float = 0.004
    leave_p: float = 0.002
    pause_p: float = 0.002
    dup_p: float = 0.03
    # an append reported failed (a timeout): half of them are lost, half land anyway. Off by
    # default, so the sweeps' seeds (and their regression seeds) keep their random sequences.
    append_fail_p: float = 0.0
    # at a rebalance, the group's generations start over at 0 (its metadata was lost, as when
    # a broker restarts) while the sync log keeps its epochs: the epoch rules of
    # protocol/epochs.py must keep epochs going up. Off by default (seed sequences stay).
    group_restart_p: float = 0.0
    max_log_delay_steps: int = 3
    commit_delay_steps: tuple[int, int] = (1, 8)
    # a committed batch's acknowledgement reaches its reader this many steps after its commit
    # point (the fence race; drawn from a generator of its own, so (0, 0) keeps every seed's
    # history as it was)
    ack_delay_steps: tuple[int, int] = (0, 0)
    # a reader starts this many steps after its task decided to read (a change-stream query
    # being set up); meanwhile the task owns the partition and nothing reads it. Drawn from a
    # generator of its own: (0, 0) keeps every seed's history as it was
    reader_start_steps: tuple[int, int] = (0, 0)
    split_p: float = 0.08
    move_p: float = 0.05
    merge_p: float = 0.08
    records_per_s: float = 4.0
    # the task core's rules (protocol/task.py), as shipped or with one broken for a teeth test;
    # the observer's CIM takes its CIM rules (fence_epochs, keep_later_answers,
    # fence_superseded_epochs). Off in the histories some regression seeds were found in:
    # resume_on_answer and reset_answered_fresh.
    rules: Rules = Rules()
    broken_planner: bool = False
    # the plan holds a hand-off in flight between two members (planner.ownerless; off: a
    # teeth test, the plan deals it out for a dead task's stale share of it)
    hold_handoffs: bool = True
    # the membership core's rules (protocol/membership.py), as shipped or broken for a teeth
    # test: the lease rule (``lease``: a JoinGroup in flight counted, the rebalance bound
    # dropped), the epoch rules (``epoch_rules``: off, the epoch is the group's generation as
    # given), ``accept_landed_epochs`` (off: an epoch that landed first is refused as stale,
    # rule 5, and the group rebalances for ever) and ``report_fresh`` (off: no member says it
    # is a fresh life, so a restarted task that has not answered is never reset: the histories
    # the regression seeds were found in, before the reset rule)
    member_rules: MemberRules = MemberRules()
    storm_limit: int = 400  # messages per simulated second; healthy runs stay under ~50
    # the simulated sink: each batch commits after a delay (in order per reader), and fails
    # with this chance (the reader then re-reads from its committed position). It draws from
    # its own random generator, so the group's and the faults' sequences stay as they were.
    sink_fail_p: float = 0.0
    batch_records: int = 1  # cut every chunk: watermarks fall on records (their tails matter)
    # the teeth tests break one rule of the reader core (protocol/reader.py)
    reader_rules: ReaderRules = ReaderRules()
    # the teeth test ignores the sink's durable position at take-over (exactly-once rule 2)
    sink_position: bool = True
    # the teeth test's sink cannot fence (exactly-once rule 4): a stopped reader's batches in
    # flight still commit when due, after the partition may have been released
    sink_fences: bool = True
    # the teeth tests of the final exactly-once checks themselves (-1: off): from this long
    # after the start, the source invents one record the stream never committed (in the first
    # chunk a reader reads), or the sink commits one record of its next batch twice
    invent_record_at_us: int = -1
    double_record_at_us: int = -1
    # the connector starts with a snapshot of this many partitions (0: none), each of 0 to
    # snapshot_chunks chunks, read snapshot_chunks_per_step chunks per step. The snapshot draws
    # from its own random generator; off by default, so the seeds' histories stay as they were.
    snapshot_partitions: int = 0
    snapshot_chunks: int = 120
    snapshot_chunks_per_step: int = 1
    # the quarantine rule (TaskConfig.quarantine_after; 0: off), and a poison partition from
    # this long after the start (-1: none), released at release_at_us (-1: never). Off unless
    # asked for: with a sink failing a tenth of the batches at random (sink_fail_p 0.1) the
    # rule at 5 parks a partition on some seeds (seed 1: a streak of failures of one partition
    # while the others committed), which is what it does in a run too (docs/operations.md)
    quarantine_after: int = 0
    poison_at_us: int = -1
    release_at_us: int = -1
    # the crash loop (-1: none): from this long after the start one task dies again and again,
    # each life coming back after crash_loop_restart_us and dying crash_loop_life_us after the
    # first epoch that lists it landed; and the bound on a live partition's unread time
    # (its watermark in the log standing still), checked from crash_loop_at_us (-1: off)
    crash_loop_at_us: int = -1
    crash_loop_kills: int = 3
    crash_loop_restart_us: int = 1_000_000
    crash_loop_life_us: int = 700_000
    crash_loop_leads: bool = True  # each life joins first and leads (off: it joins last)
    # each life's first generation comes to nothing: its leader (another task) dies once it
    # has sent the assignments, before it plans (restarted a session later); the life is
    # assigned that generation but never permitted to read in it
    crash_loop_leader_dies: bool = False
    unread_limit_us: int = -1
    # TaskConfig.probation: a restarted member gets no partition for this long (0: off, the
    # teeth test of the crash loop: balancing hands the looping task its partitions back)
    probation_us: int = 10_000_000
    # "mutable": a MUTABLE_KEY_RANGE stream (runtime/sim/mutable.py) instead of splits, moves
    # and merges; move_in_holds=False is its teeth (Rules.move_in_holds)
    partition_mode: str = "immutable"


class SimResult(msgspec.Struct, frozen=True):
    seed: int
    passed: bool
    violation: str = ""
    steps: int = 0
    rebalances: int = 0
    epochs: int = 0
    crashes: int = 0
    pauses: int = 0
    partitions: int = 0
    records: int = 0
    duplicates: int = 0
    append_failures: int = 0
    # restarted members planned as reset (their earlier lives' partitions dealt out)
    resets: int = 0
    read_on_answer: int = 0  # readers a rejoined task started before its generation's epoch
    sink_failures: int = 0  # batches the simulated sink failed (sink_fail_p, or a lapsed lease)
    # batches a fence found past their commit point (ack_delay_steps: the fence race)
    fence_committed: int = 0
    snapshot_chunks: int = 0  # snapshot chunks (records) that reached the sink
    # readers of snapshot partitions started after the first of each (a hand-off, a crash, a
    # pause past the lease: read again from their committed chunks), and faults (crashes,
    # pauses, joins, leaves) while the snapshot was not done
    snapshot_resumed: int = 0
    snapshot_faults: int = 0
    # the poison partition: times the log showed it newly quarantined, tasks whose reader
    # failed on it, its failed batches, and whether a release read it again to the end
    quarantined: int = 0
    poison_hops: int = 0
    poison_failures: int = 0
    released_and_resumed: bool = False
    # plans in which a fresh leader dealt out its own partitions (Rules.reset_fresh_leader)
    yields: int = 0
    # the crash loop: its kills, and the longest a live partition's watermark in the log stood
    # still from crash_loop_at_us on (0 without a crash loop)
    crash_loop_kills: int = 0
    max_unread_us: int = 0
    # leaders killed before planning the looping life's first generation (crash_loop_leader_dies)
    loop_leaders_killed: int = 0
    # MUTABLE_KEY_RANGE: readers started at a released move-in hold (passing its events)
    holds_passed: int = 0
    # ... and partitions announced twice whose second registration gave way to the first
    claims_lost: int = 0


class _Reader:
    """One simulated partition reader: a :class:`ReaderCore`, its source query (the model read
    step by step) and its batches in the simulated sink, committed in order."""

    __slots__ = ("acking", "committed_ids", "core", "inflight", "pos", "query", "token")

    def __init__(self, token: str, core: ReaderCore) -> None:
        self.token = token
        self.core = core
        self.query = -1  # the running query (-1: none)
        self.pos = 0  # where the running query reads next
        # (due step, batch id, records, watermark): the sink commits them in order
        self.inflight: deque[tuple[int, int, tuple[DataChange, ...], int]] = deque()
        # (due step, batch id): past the commit point, the acknowledgement still on its way
        self.acking: deque[tuple[int, int]] = deque()
        # what this reader got committed, and what it started past: none may come again
        self.committed_ids: set[Identity] = set()


class _Starting(msgspec.Struct, frozen=True):
    """A reader being set up (``reader_start_steps``): it starts when this event is due."""

    command: StartReader


class _Assign(msgspec.Struct, frozen=True):
    """A generation's assignment on its way to one member (it lags behind the leader's)."""

    generation: int
    epoch: int
    leader: str
    members: tuple[str, ...]
    sent: int  # when its SyncGroup was sent (the coordinator restarted its session then)
    fresh: tuple[str, ...] = ()  # members never assigned a generation (their JoinGroups said)


class _Node:
    def __init__(self, task_id: str, core: TaskCore, member: MemberCore, join_order: int) -> None:
        self.id = task_id
        self.core = core
        # its membership adapter's core: its epochs and lease facts (protocol/membership.py)
        self.member = member
        self.join_order = join_order
        self.alive = True
        self.paused_until = -1
        self.read_offset = 0
        self.readers: dict[str, _Reader] = {}
        # (due step, seq, event)
        self.inbox: list[tuple[int, int, TaskEvent | _Assign | _Starting]] = []
        self.starting: dict[str, StartReader] = {}  # readers being set up, by token
        self.expelled = False
        self.last_land = 0
        # readers' newest committed positions, handed to the core once per step (coalesced)
        self.commits: dict[str, tuple[int, Ids]] = {}
        # readers' partition-start reports, handed to the core in order before the commits
        # (as the shell does: actors/task.py, ``_flush_reports``)
        self.announced: list[PartitionsAnnounced] = []
        # its JoinGroup in flight: (arrival step, or -1 when lost; step its request times out)
        self.join: tuple[int, int] | None = None

    def paused(self, step: int) -> bool:
        return step < self.paused_until


class Simulation:
    def __init__(self, params: SimParams) -> None:
        self.p = params
        self.rng = Random(params.seed)
        start = 1_700_000_000_000_000
        self.t0 = start
        self.mutable = params.partition_mode == "mutable"
        self.cores: list[TaskCore] = []  # every life of every task, for its counters
        self.mutable_model = MutableStreamModel(
            MutableStreamParams(
                seed=params.seed,
                roots=params.roots,
                start_ts=start,
                churn_until=start + params.churn_us,
            )
        )
        self.key_newest: dict[str, int] = {}  # mutable: each key's newest write in the sink
        self.model: StreamModel | MutableStreamModel = self.mutable_model
        if not self.mutable:
            self.model = StreamModel(
                StreamParams(
                    seed=params.seed,
                    roots=params.roots,
                    start_ts=start,
                    round_us=2_000_000,
                    split_p=params.split_p,
                    move_p=params.move_p,
                    merge_p=params.merge_p,
                    max_partitions=40,
                    records_per_s=params.records_per_s,
                    churn_until=start + params.churn_us,
                )
            )
        self.step = 0
        self.seq = itertools.count()
        self.nodes: dict[str, _Node] = {}
        self.log: list[SyncMessage] = []
        # (land step, seq, producer, payload): a paused producer's messages wait in its socket
        # buffer and land only after it resumes, possibly long after newer epochs.
        self.pending_log: list[tuple[int, int, str, bytes]] = []
        self.rules = params.rules
        self.observer = Cim(
            fence_epochs=self.rules.fence_epochs,
            keep_later_answers=self.rules.keep_later_answers,
            fence_superseded_epochs=self.rules.fence_superseded_epochs,
        )
        self.max_wm: dict[str, int] = {}
        self.finished: set[str] = set()
        self.delivered: Counter[tuple[int, str, str]] = Counter()
        self.ids = itertools.count()
        self.joins = itertools.count()
        # group coordinator: members and the step of their last request it processed; a
        # rebalance prepares from preparing_since (-1: stable) until every member joined or the
        # rebalance timeout passed (protocol/lease.py, K1-K4)
        self.generation = -1
        self.group: dict[str, int] = {}  # member -> last heartbeat step
        self.preparing_since = -1
        self.joined: set[str] = set()
        self.churning = True
        # a generation whose leader has not sent its SyncGroup yet: (members, leader)
        self.pending: tuple[tuple[str, ...], str] | None = None
        self.timing = LeaseTiming(
            session=params.session_timeout_us,
            rebalance=params.rebalance_timeout_us,
            margin=params.lease_margin_us,
        )
        self.member_rules = params.member_rules
        self.stats: Counter[str] = Counter()
        self.restarts: list[tuple[int, str]] = []  # (step, task id) of crashed tasks to restart
        self.log_sizes: deque[int] = deque(maxlen=self.steps(1_000_000) + 1)
        self.planner: Planner = (
            plan_broken
            if params.broken_planner
            else functools.partial(plan, hold_handoffs=params.hold_handoffs)
        )
        self.sink_rng = Random(f"sink:{params.seed}")
        self.ack_rng = Random(f"ack:{params.seed}")
        self.lag_rng = Random(f"lag:{params.seed}")
        self.start_rng = Random(f"start:{params.seed}")
        # the sink's own durable record: each partition's position, moved atomically with
        # every batch it commits (docs/design.md#exactly-once-output, rule 2)
        self.sink_tails: dict[str, PartitionTail] = {}
        self.orphans: list[tuple[_Node, _Reader]] = []  # stopped readers unfenced batches
        # the poison partition (poison_at_us): its token, its poison record once met, the
        # tasks whose reader failed on it, whether the sink healed (the release), and the
        # quarantine the log shows (its since; -1: none)
        self.poison_token = min(self.model.roots) if params.poison_at_us >= 0 else ""
        self.poison: Identity | None = None
        self.poison_ts = -1
        self.poison_tasks: set[str] = set()
        self.healed = False
        self.quarantine_seen = -1
        # the crash loop (crash_loop_at_us): the looping task, the step of its next kill or
        # restart (-1: none due; its kill waits for an epoch listing it), the log's epoch when
        # it came back, and the step each partition's watermark in the log last moved
        self.looping = ""
        self.loop_kill_at = -1
        self.loop_restart_at = -1
        self.loop_epoch = -1
        self.loop_first_generation = False  # its life's first generation not completed yet
        self.moved: dict[str, int] = {}
        self.max_unread = 0
        # the snapshot at T, one microsecond before the stream's roots (protocol/snapshot.py)
        self.snapshot_ts = start - 1
        self.snapshot = snapshot_records(
            params.seed, self.snapshot_ts, params.snapshot_partitions, params.snapshot_chunks
        )
        self.snapshot_plan: SnapshotPlan | None = None
        if self.snapshot:
            items = tuple(
                SnapshotItem(token, chunks[0].table if chunks else "", b"")
                for token, chunks in self.snapshot.items()
            )
            self.snapshot_plan = SnapshotPlan(
                read_ts=self.snapshot_ts, total=len(items), chunk_rows=1, items=items
            )

    # -- clock -------------------------------------------------------------------------------
    def now(self) -> int:
        return self.t0 + self.step * self.p.step_us

    def steps(self, us: int) -> int:
        return max(1, us // self.p.step_us)

    # -- nodes ---------------------------------------------------------------------------------
    def start_node(self, task_id: str | None = None) -> _Node:
        """A new task; with ``task_id``, a crashed task restarted under its old id (a fresh core
        that finds its previous life's state in the sync log)."""
        if task_id is None:
            task_id = f"t{next(self.ids):02d}"
        config = TaskConfig(
            task_id=task_id,
            cap=self.p.cap,
            answer_timeout=self.p.answer_timeout_us,
            publish_interval=250_000,
            negotiate_interval=200_000,
            checkpoint_interval=5_000_000,
            rules=self.rules,
            snapshot=self.snapshot_plan is not None,
            quarantine_after=self.p.quarantine_after,
            probation=self.p.probation_us,
            mutable=self.mutable,
        )
        core = TaskCore(config, Random(self.rng.getrandbits(32)))
        self.cores.append(core)
        member = MemberCore(task_id, self.timing, self.member_rules)
        node = _Node(task_id, core, member, next(self.joins))
        self.nodes[task_id] = node
        # Subscription order: replay the sync log first, then join the group.
        self.read_log(node)
        self.enter_group(node)
        return node

    def enter_group(self, node: _Node) -> None:
        """A new member's JoinGroup: it starts (or joins) a rebalance, having joined it."""
        now = self.now()
        node.member.handle(MembershipLost(), now)
        node.member.handle(JoinSent(now), now)
        node.join = None
        self.group[node.id] = self.step
        self.begin_rebalance()
        self.joined.add(node.id)

    def deliver(self, node: _Node, event: TaskEvent, delay_steps: int = 0) -> None:
        heapq.heappush(node.inbox, (self.step + delay_steps, next(self.seq), event))

    def handle(self, node: _Node, event: TaskEvent) -> None:
        commands = node.core.handle(event, self.now())
        for command in commands:
            self.execute(node, command)

    def execute(self, node: _Node, command: TaskCommand) -> None:
        match command:
            case Publish():
                payload = messages.encode(command.message)
                if self.p.append_fail_p and self.rng.random() < self.p.append_fail_p:
                    failed = PublishFailed("append timed out", own_state_ts(command.message))
                    self.deliver(node, failed, 1)
                    self.stats["append_failures"] += 1
                    if self.rng.random() < 0.5:
                        return  # lost
                # One producer's messages land in the order it sent them (as on one Kafka
                # partition); different producers' messages interleave at random.
                delay = self.rng.randint(0, self.p.max_log_delay_steps)
                land = max(self.step + delay, node.last_land)
                node.last_land = land
                heapq.heappush(self.pending_log, (land, next(self.seq), node.id, payload))
                if self.rng.random() < self.p.dup_p:  # a producer retry writes it twice
                    heapq.heappush(self.pending_log, (land + 1, next(self.seq), node.id, payload))
            case StartReader():
                if node.core.cim.epoch < node.core.continuous_since:
                    self.stats["read_on_answer"] += 1  # before its generation's epoch
                lo, hi = self.p.reader_start_steps
                delay = self.start_rng.randint(lo, hi) if hi else 0
                if delay:
                    node.starting[command.token] = command
                    event = _Starting(command)
                    heapq.heappush(node.inbox, (self.step + delay, next(self.seq), event))
                else:
                    self.start_reader(node, command)
            case StopReader():
                reader = node.readers.get(command.token)
                starting = node.starting.pop(command.token, None)
                if starting is not None:  # stopped while being set up: it read nothing
                    stopped = ReaderStopped(command.token, starting.start_ts, starting.tail)
                    self.deliver(node, stopped, 0)
                elif reader is not None:
                    stop = StopRequested(command.reason, command.drain)
                    self.reader_do(node, reader, reader.core.handle(stop, self.now()))
            case Alert():
                self.stats[f"alert.{command.kind}"] += 1
            case RequestPlan():
                self.stats["resets"] += len(command.reset)
                roots: tuple[Partition, ...] = ()
                stream_start = -1
                if command.need_roots and self.mutable:
                    start = self.mutable_model.root_record()
                    roots = tuple(Partition(token=t, start_ts=start.start_ts) for t in start.tokens)
                    stream_start = self.t0
                elif command.need_roots:
                    assert isinstance(self.model, StreamModel)
                    root = self.model.root_record()
                    roots = tuple(
                        Partition(token=c.token, start_ts=root.start_ts) for c in root.children
                    )
                    stream_start = self.t0
                snapshot = self.snapshot_plan if command.snapshot else None
                if snapshot is not None:
                    # T: the stream's start; its roots start after it (protocol/snapshot.py)
                    stream_start = snapshot.read_ts
                    assert snapshots.stream_after(stream_start) == self.t0
                result = self.planner(
                    node.core.cim,
                    command.members,
                    node.id,
                    command.generation,
                    self.now(),
                    self.p.cap,
                    Random(self.rng.getrandbits(32)),
                    roots,
                    stream_start,
                    command.reset,
                    snapshot=snapshot,
                    leader_yields=command.leader_yields,
                )
                self.stats["yields"] += bool(result.yielded)
                self.deliver(node, PlanReady(result), 1)

    def start_reader(self, node: _Node, command: StartReader) -> None:
        token = command.token
        if snapshots.is_snapshot(token):
            if token not in self.snapshot:
                raise Violation(f"{node.id} reads {token}, which no snapshot holds")
            parents: tuple[str, ...] = ()
            self.stats["snapshot_readers"] += 1
        else:
            parents = self.model.info(token).parents
        for parent in parents:
            if parent not in self.finished:
                raise Violation(f"{node.id} reads {token} before its parent {parent} finished")
        for other in self.nodes.values():
            busy = other is not node and other.alive and token in other.readers
            if busy and self.active(other):
                raise Violation(f"{node.id} and {other.id} both read {token}")
        config = ReaderConfig(
            token,
            batch_records=self.p.batch_records,
            max_backoff=1_000_000,
            drain_timeout=2_000_000,
            stall_timeout=10_000_000,
            rules=self.p.reader_rules,
            mutable=self.mutable and not snapshots.is_snapshot(token),
        )
        start = Position(command.start_ts, command.tail)
        core = ReaderCore(config, start, command.hold)
        if command.hold is not None:
            self.stats["holds_passed"] += 1
        reader = node.readers[token] = _Reader(token, core)
        reader.committed_ids = {(start.ts, txn, seq) for txn, seq in start.ids}
        self.stats["readers_started"] += 1
        durable = self.sink_tails.get(token)
        sink = durable.position() if durable is not None and self.p.sink_position else None
        self.reader_do(node, reader, reader.core.handle(Start(sink), self.now()))

    # -- the sync log --------------------------------------------------------------------------
    def land_messages(self) -> None:
        held: list[tuple[int, int, str, bytes]] = []
        while self.pending_log and self.pending_log[0][0] <= self.step:
            entry = heapq.heappop(self.pending_log)
            producer = self.nodes[entry[2]]
            if producer.alive and producer.paused(self.step):
                held.append((producer.paused_until, *entry[1:]))
                continue
            message = messages.decode(entry[3])
            offset = len(self.log)
            self.log.append(message)
            self.observe(offset, message)
        for entry in held:
            heapq.heappush(self.pending_log, entry)

    def observe(self, offset: int, message: SyncMessage) -> None:
        before = self.observer.view(message.task_id).state_ts
        if self.observer.apply(offset, message) is not None:
            return
        if not isinstance(message, StateMessage | EpochMessage):
            return
        if isinstance(message, EpochMessage):
            self.stats["epochs"] += 1
        for state in message.connector_state:
            if state.task_id != message.task_id or state.state_timestamp < before:
                continue  # not applied: only a sender's own, newer state counts
            credited = self.observer.view(message.task_id).partitions
            for part in state.data:
                if part.status == "incoming":
                    continue
                if part.claim and part.token not in credited:
                    continue  # a claim the CIM dropped: another registration landed first
                if part.watermark < self.max_wm.get(part.token, 0):
                    raise Violation(
                        f"watermark of {part.token} went back from "
                        f"{self.max_wm[part.token]} to {part.watermark} ({state.task_id})"
                    )
                if part.watermark > self.max_wm.get(part.token, -1):
                    self.moved[part.token] = self.step
                self.max_wm[part.token] = part.watermark

    def read_log(self, node: _Node) -> None:
        while node.read_offset < len(self.log):
            offset = node.read_offset
            node.read_offset += 1
            self.handle(node, SyncRead(offset, self.log[offset]))
            if self.rng.random() < self.p.dup_p:  # a consumer re-delivers after a retry
                self.handle(node, SyncRead(offset, self.log[offset]))

    # -- the group coordinator -------------------------------------------------------------------
    def begin_rebalance(self) -> None:
        if self.preparing_since < 0:
            self.preparing_since = self.step
            self.joined = set()
            self.stats["rebalances_started"] += 1
        if self.pending is not None:
            # the superseded generation's members waiting for its assignment are answered
            # REBALANCE_IN_PROGRESS on their SyncGroup and rejoin
            members, leader = self.pending
            self.pending = None
            self.stats["superseded_generations"] += 1
            for member in members:
                node = self.nodes[member]
                running = node.alive and not node.paused(self.step)
                if member != leader and member in self.group and running:
                    self.send_join(node)

    def renew(self, node: _Node, commands: list[MemberCommand]) -> None:
        """The membership adapter hands the task core the lease its member core reports."""
        for command in commands:
            if isinstance(command, LeaseUntil):
                self.deliver(node, Lease(command.until))

    def send_join(self, node: _Node) -> None:
        now = self.now()
        lease = node.member.handle(JoinSent(now), now)
        lo, hi = self.p.join_delay_steps
        lost = self.churning and self.p.join_loss_p > 0 and self.rng.random() < self.p.join_loss_p
        arrive = -1 if lost else self.step + self.rng.randint(lo, hi)
        node.join = (arrive, self.step + self.steps(self.p.request_timeout_us))
        self.renew(node, lease)  # the broken rule counts a join in flight

    def run_group(self) -> None:
        step = self.step
        timeout = self.steps(self.p.session_timeout_us)
        hb = self.steps(self.p.heartbeat_us)
        for task_id in list(self.group):
            node = self.nodes[task_id]
            running = node.alive and not node.paused(step)
            join = node.join
            if join is not None and 0 <= join[0] <= step:  # its JoinGroup arrives
                # held by the coordinator until the join phase ends (a JoinGroup in a stable
                # group starts a rebalance)
                node.join = (-2, join[1])
                self.begin_rebalance()
                self.joined.add(task_id)
                self.group[task_id] = step
            elif running and join is not None and join[0] == -1 and step >= join[1]:
                node.member.handle(JoinFailed(), self.now())  # timed out: no proof (A3)
                self.send_join(node)
            elif running and join is None and (step - node.join_order) % hb == 0:
                # a heartbeat, answered at once: NONE, or REBALANCE_IN_PROGRESS (and the
                # member rejoins at once, sending no heartbeat until it is answered)
                self.group[task_id] = step
                rebalancing = self.preparing_since >= 0
                now = self.now()
                self.renew(node, node.member.handle(HeartbeatAnswered(now, rebalancing), now))
                if rebalancing and task_id not in self.joined:
                    self.send_join(node)
            elif (
                running
                and join is not None
                and self.p.heartbeat_while_rebalancing
                and (step - node.join_order) % hb == 0
                and task_id in self.group
            ):
                # its rebalance is in flight and the adapter heartbeats on a second connection:
                # the coordinator restarts its session (K1) and answers REBALANCE_IN_PROGRESS
                # while a rebalance is being prepared, else NONE (Kafka's CompletingRebalance)
                self.group[task_id] = step
                self.stats["heartbeats_while_rebalancing"] += 1
                now = self.now()
                answered = HeartbeatAnswered(now, rebalancing=self.preparing_since >= 0)
                self.renew(node, node.member.handle(answered, now))
            held = self.preparing_since >= 0 and task_id in self.joined  # kept (K4)
            if self.pending is not None and task_id != self.pending[1]:
                held = held or task_id in self.pending[0]  # waiting for the leader's sync
            if held or step - self.group[task_id] < timeout:
                continue
            del self.group[task_id]  # its session expired (K1, K3)
            node.expelled = True
            self.begin_rebalance()
        self.sync_pending()
        if self.preparing_since < 0 or not self.group:
            return
        done = all(m in self.joined for m in self.group)
        if not done and step < self.preparing_since + self.steps(self.p.rebalance_timeout_us):
            return
        # The join phase ends: who did not join is removed (K2); the others' sessions restart.
        self.preparing_since = -1
        for task_id in [m for m in self.group if m not in self.joined]:
            del self.group[task_id]
            self.nodes[task_id].expelled = True
            self.stats["join_phase_removals"] += 1
        for task_id in self.group:
            self.group[task_id] = step
        self.joined = set()
        if self.group:
            if self.p.group_restart_p and self.rng.random() < self.p.group_restart_p:
                self.generation = -1
                self.stats["group_restarts"] += 1
            self.generation += 1
            members = tuple(sorted(self.group))
            leader = min(members, key=lambda m: self.nodes[m].join_order)
            self.stats["rebalances"] += 1
            self.pending = (members, leader)
            self.sync_pending()

    def sync_pending(self) -> None:
        """The generation's assignments reach its members once its leader, running, has sent
        them in its SyncGroup; a leader paused or dead since its JoinGroup never does, and a
        rebalance that begins first supersedes the generation (nobody gets it)."""
        if self.pending is None:
            return
        members, leader = self.pending
        node = self.nodes[leader]
        if leader in self.group and node.alive and not node.paused(self.step):
            self.pending = None
            self.complete_rebalance(members, leader)

    def complete_rebalance(self, members: tuple[str, ...], leader: str) -> None:
        # the leader's member core numbers the generation from what every member said in its
        # JoinGroup (protocol/membership.py): the newest epoch it knows, and whether it is a
        # fresh life (never assigned a generation; an assignment is taken only before the next
        # JoinGroup is sent)
        said = [self._said(self.nodes[m]) for m in members]
        chief = self.nodes[leader]
        numbered = chief.member.number(self.generation, said, chief.core.cim.epoch)
        epoch, fresh = numbered.epoch, numbered.fresh
        for member in members:
            node = self.nodes[member]
            node.expelled = False
            if member in self.group:
                # the coordinator answers every member's SyncGroup with its assignment and
                # restarts its session (Kafka's propagateAssignment; K1): a follower held
                # waiting for a paused leader is not expelled the moment the leader syncs
                self.group[member] = self.step
            lo, hi = self.p.follower_lag_us
            lag = 0 if member == leader else self.lag_rng.randint(lo, hi) // self.p.step_us
            item = _Assign(self.generation, epoch, leader, members, self.now(), fresh)
            if lag:
                # still waiting for its answer: no heartbeat meanwhile, nothing renewed yet
                heapq.heappush(node.inbox, (self.step + lag, next(self.seq), item))
            else:
                self.assign(node, item)
        if self.loop_first_generation and self.looping in members:
            self.loop_first_generation = False
            if self.p.crash_loop_leader_dies and leader != self.looping:
                # the looping life's first generation comes to nothing: its leader dies
                # before it plans, and comes back a session later
                chief.alive = False
                chief.readers.clear()
                self.stats["crashes"] += 1
                self.stats["loop_leaders_killed"] += 1
                self.restarts.append((self.step + self.steps(self.p.session_timeout_us), leader))

    def _said(self, node: _Node) -> Said:
        """What a member says in its JoinGroup (the Kafka adapter's assignor metadata): its
        task core, told it joins, tells whether it has read nothing (``TaskCore.says_fresh``),
        as the task actor does for the Kafka adapter."""
        floor = node.core.cim.epoch
        self.handle(node, Joining(node.member.known(floor)))
        return node.member.said(floor, unread=node.core.says_fresh)

    def assign(self, node: _Node, item: _Assign) -> None:
        """A generation's assignment reaches a member: its member core decides whether it takes
        it (protocol/membership.py), as the Kafka membership adapter's does."""
        if item.generation != self.generation or self.preparing_since >= 0:
            # a newer rebalance began before its answer came: answered REBALANCE_IN_PROGRESS
            # (no proof of membership), it goes back to heartbeating and rejoins from there
            node.join = None
            self.stats["lagging_assignments_superseded"] += 1
            return
        cim = node.core.cim
        now = self.now()
        assigned = Assigned(
            item.epoch,
            self.generation,
            item.leader,
            item.members,
            item.fresh,
            floor=cim.epoch,
            logged=Logged(cim.epoch, cim.leader, cim.members),
        )
        [verdict] = node.member.handle(assigned, now)
        assert isinstance(verdict, Take | Refuse), verdict
        if verdict.landed_first:
            self.stats["epochs_landed_first"] += 1
        # its JoinGroup answered, then its SyncGroup (sent when the generation completed,
        # answered with the assignment after a delay): both prove membership from their send
        # times
        node.member.handle(JoinAnswered(), now)
        node.member.handle(SyncAnswered(item.sent), now)
        node.join = None
        if isinstance(verdict, Refuse):
            self.stats["stale_epochs"] += 1
            self.deliver(node, Lost(verdict.reason))
            node.member.handle(MembershipLost(verdict.reason), now)
            node.member.handle(JoinSent(now), now)
            self.begin_rebalance()  # it rejoins at once, telling the next leader
            self.joined.add(node.id)
            return
        delay = self.rng.randint(0, 3)  # the adapter's queue to the core
        joined = Joined(verdict.epoch, verdict.leader, verdict.members, fresh=verdict.fresh)
        self.deliver(node, joined, delay)
        until = node.member.lease_until()
        if until is not None:
            self.deliver(node, Lease(until), delay)

    # -- readers and the sink --------------------------------------------------------------------
    def active(self, node: _Node) -> bool:
        """A node's readers read only while it runs and its lease holds: the rule the real
        reader checks before every batch (``TaskCore.lease_valid``, through ``permit()``)."""
        return not node.paused(self.step) and node.core.lease_valid(self.now())

    def reader_do(self, node: _Node, reader: _Reader, commands: list[ReaderCommand]) -> None:
        """Carry out a reader core's commands."""
        for command in commands:
            match command:
                case StartQuery():
                    reader.query = command.query
                    # a snapshot partition is read again from its first chunk (at T)
                    snapshot = snapshots.is_snapshot(reader.token)
                    reader.pos = 0 if snapshot else command.start_ts
                case CancelQuery():
                    reader.query = -1
                case PutBatch():
                    lo, hi = self.p.commit_delay_steps
                    due = self.step + self.sink_rng.randint(lo, hi)
                    if reader.inflight:
                        due = max(due, reader.inflight[-1][0])
                    reader.inflight.append((due, command.batch, command.records, command.watermark))
                case FlushBatches():
                    pass  # the simulated sink commits each batch when it is due, not by age
                case FenceBatches() if not self.p.sink_fences:
                    self.orphans.append((node, reader))  # its batches commit when due
                    held = BatchesFenced(held=False)
                    self.reader_do(node, reader, reader.core.handle(held, self.now()))
                case FenceBatches():
                    # the sink's fence (protocol/commit.py, CommitFences): a batch past its
                    # commit point (its acknowledgement on its way) is committed, every one
                    # still in flight is fenced
                    asked = set(command.batches)
                    passed = tuple(b for _, b in reader.acking if b in asked)
                    reader.acking = deque(a for a in reader.acking if a[1] not in asked)
                    kept = [b for b in reader.inflight if b[1] not in asked]
                    self.stats["batches_fenced"] += len(reader.inflight) - len(kept)
                    self.stats["fence_committed"] += len(passed)
                    reader.inflight = deque(kept)
                    answer = BatchesFenced(committed=passed)
                    self.reader_do(node, reader, reader.core.handle(answer, self.now()))
                case Report():
                    event = command.event
                    if isinstance(event, ReaderCommitted):
                        # the shell's coalescing (actors/task.py, TaskActor.report): a newer
                        # committed position of a partition supersedes an older one
                        seen = node.commits.get(event.token)
                        new = Position(event.watermark, event.tail)
                        if seen is None or Position(*seen).newer(new) is new:
                            node.commits[event.token] = (event.watermark, event.tail)
                    elif isinstance(event, PartitionsAnnounced):
                        node.announced.append(event)
                    else:
                        self.deliver(node, event)
                case Done():
                    if node.readers.get(reader.token) is reader:
                        del node.readers[reader.token]
                    if isinstance(command.end, ReaderFinished):
                        self.finished.add(reader.token)
                        self.deliver(node, command.end)
                    else:
                        self.deliver(node, command.end, 1)

    def flush_commits(self, node: _Node) -> None:
        """Hand the core every reader's newest committed position in one event, as the shell
        does (``ReadersCommitted``); partition starts the readers reported go first, in order."""
        announced, node.announced = node.announced, []
        for event in announced:
            self.handle(node, event)
        if node.commits:
            commits, node.commits = node.commits, {}
            self.handle(
                node,
                ReadersCommitted(
                    tuple((token, wm) for token, (wm, _) in commits.items()),
                    tuple((token, tail) for token, (_, tail) in commits.items() if tail),
                ),
            )

    def tick_due(self, node: _Node) -> None:
        """The shell's timer (actors/task.py, ``timer_loop``): a ``TaskTick`` only once the
        core's next deadline (``TaskCore.next_deadline``) has come, not every step."""
        deadline = node.core.next_deadline()
        if deadline is not None and deadline <= self.now():
            self.handle(node, TaskTick())

    def run_sink(self, node: _Node, reader: _Reader) -> None:
        """The sink's side: batches whose commit is due commit, in order, or fail (with
        ``sink_fail_p``, or when the lease of the task that put them ran out: the sink checks
        it right before the commit point, so a zombie commits nothing). A failed batch fails
        every later one of the reader too (they commit in order). Committed records count as
        delivered, whatever becomes of the reader after."""
        now = self.now()
        while reader.acking and reader.acking[0][0] <= self.step:
            _, acked = reader.acking.popleft()
            self.reader_do(node, reader, reader.core.handle(BatchCommitted(acked), self.now()))
        lease = node.core.lease_valid(self.now())
        while reader.inflight and reader.inflight[0][0] <= self.step:
            _, batch, records, watermark = reader.inflight.popleft()
            if self.poisoned(reader.token, records):
                self.stats["poison_failures"] += 1
                self.poison_tasks.add(node.id)
                failed = [batch] + [b for _, b, _, _ in reader.inflight]
                reader.inflight.clear()
                error = "TypedError: value 1e400 does not fit FLOAT64"
                for b in failed:
                    self.reader_do(node, reader, reader.core.handle(BatchFailed(b, error), now))
                return
            if not lease or self.sink_rng.random() < self.p.sink_fail_p:
                self.stats["sink_failures"] += 1
                failed = [batch] + [b for _, b, _, _ in reader.inflight]
                reader.inflight.clear()
                for b in failed:
                    self.reader_do(
                        node, reader, reader.core.handle(BatchFailed(b, "injected"), self.now())
                    )
                return
            for record in records:
                identity = record.identity
                if identity in reader.committed_ids:
                    raise Violation(
                        f"re-read not dropped: {reader.token} record {identity} reached the "
                        f"sink again from the reader that had it committed"
                    )
                reader.committed_ids.add(identity)
                if self.mutable and identity not in self.delivered:
                    self.check_key_order(reader.token, record)
                self.delivered[identity] += 1
            if records and self._fault_due("double_record_at_us"):
                self.delivered[records[0].identity] += 1  # the teeth: a row written twice
            durable = self.sink_tails.setdefault(reader.token, PartitionTail())
            durable.commit(watermark, records)
            lo, hi = self.p.ack_delay_steps
            if hi > 0:
                due = self.step + self.ack_rng.randint(lo, hi)
                if reader.acking:
                    due = max(due, reader.acking[-1][0])
                reader.acking.append((due, batch))
                continue
            self.reader_do(node, reader, reader.core.handle(BatchCommitted(batch), self.now()))

    def check_key_order(self, token: str, record: DataChange) -> None:
        """Per-key timestamp order (MUTABLE_KEY_RANGE): no write of a key reaches the sink
        after a later write of that key did."""
        key = write_key(record)
        newest = self.key_newest.get(key, -1)
        if record.commit_ts < newest:
            raise Violation(
                f"key {key} out of timestamp order: its write at {record.commit_ts} (from "
                f"{token}) reached the sink after its write at {newest}"
            )
        self.key_newest[key] = record.commit_ts

    def poisoned(self, token: str, records: tuple[DataChange, ...]) -> bool:
        """Whether this batch holds the poison record (the first record of the poison
        partition committed ``poison_at_us`` after the start), and the sink is not healed."""
        if token != self.poison_token or self.healed:
            return False
        if self.poison is None:
            at = self.t0 + self.p.poison_at_us
            first = next((r for r in records if r.commit_ts >= at), None)
            if first is None:
                return False
            self.poison, self.poison_ts = first.identity, first.commit_ts
        return any(r.identity == self.poison for r in records)

    def run_readers(self, node: _Node) -> None:
        now = self.now()
        lease = node.core.lease_valid(now)
        for orphan in [o for o in self.orphans if o[0] is node]:  # only with sink_fences off
            self.run_sink(node, orphan[1])
            if not orphan[1].inflight:
                self.orphans.remove(orphan)
        for reader in list(node.readers.values()):
            self.run_sink(node, reader)
            if not lease or node.readers.get(reader.token) is not reader:
                continue
            if reader.query >= 0 and snapshots.is_snapshot(reader.token):
                # a snapshot partition's chunks, a few per step, then the end (no children)
                query = reader.query
                chunks = self.snapshot[reader.token]
                step = self.p.snapshot_chunks_per_step
                part = chunks[reader.pos : reader.pos + step]
                reader.pos += step
                self.reader_do(node, reader, reader.core.handle(Chunk(query, part), now))
                if reader.pos >= len(chunks) and reader.query == query:
                    reader.query = -1
                    self.reader_do(node, reader, reader.core.handle(QueryEnded(query), now))
            elif reader.query >= 0:
                query = reader.query
                chunk: list[SourceRecord] = []
                ended = False
                for record in self.model.records(reader.token, reader.pos, now):
                    chunk.append(record)
                    ended = ended or isinstance(record, ChildPartitions | PartitionEnd)
                if not ended:
                    if self._fault_due("invent_record_at_us"):
                        chunk.append(_invented(now))  # the teeth: never committed
                    chunk.append(Heartbeat(now))
                reader.pos = now + 1
                self.reader_do(node, reader, reader.core.handle(Chunk(query, tuple(chunk)), now))
                if ended and reader.query == query:
                    reader.query = -1
                    self.reader_do(node, reader, reader.core.handle(QueryEnded(query), now))
            self.reader_do(node, reader, reader.core.handle(ReaderTick(), now))

    def _fault_due(self, name: str) -> bool:
        """Whether the one-off teeth fault ``name`` (a ``SimParams`` field: when, after the
        start) is due now and has not happened yet; it happens once."""
        at: int = getattr(self.p, name)
        if at < 0 or self.now() < self.t0 + at or self.stats[name]:
            return False
        self.stats[name] += 1
        return True

    # -- faults -----------------------------------------------------------------------------------
    def faults(self) -> None:
        alive = [n for n in self.nodes.values() if n.alive]
        r = self.rng.random
        before = sum(self.stats[k] for k in ("crashes", "joins", "leaves", "pauses"))
        try:
            self._faults(alive, r)
        finally:
            after = sum(self.stats[k] for k in ("crashes", "joins", "leaves", "pauses"))
            state = self.observer.snapshot
            during = state.plan is None or not state.complete()
            if after > before and self.snapshot_plan is not None and during:
                self.stats["snapshot_faults"] += after - before

    def _faults(self, alive: list[_Node], r: Callable[[], float]) -> None:
        if len(alive) > 1 and r() < self.p.crash_p:
            victim = self.rng.choice(alive)
            victim.alive = False
            victim.readers.clear()
            self.stats["crashes"] += 1
            if r() < self.p.restart_p:
                # restarted under the same id, before or after its session has timed out
                span = self.steps(self.p.session_timeout_us)
                at = self.step + self.rng.randint(span // 4, 2 * span)
                self.restarts.append((at, victim.id))
        if len(alive) < self.p.max_tasks and r() < self.p.join_p:
            self.start_node()
            self.stats["joins"] += 1
        if len(alive) > 1 and r() < self.p.leave_p:
            victim = self.rng.choice(alive)
            victim.alive = False
            victim.readers.clear()
            self.group.pop(victim.id, None)
            self.joined.discard(victim.id)
            self.begin_rebalance()
            self.stats["leaves"] += 1
        if len(alive) > 1 and r() < self.p.pause_p:
            victim = self.rng.choice(alive)
            if not victim.paused(self.step):
                span = self.steps(self.p.session_timeout_us)
                victim.paused_until = self.step + self.rng.randint(span // 2, 3 * span)
                self.stats["pauses"] += 1

    def crash_loop(self) -> None:
        """The crash loop (``crash_loop_at_us``): kill the looping task, bring it back under its
        id joining first, kill it again once an epoch listing it has landed and it lived
        ``crash_loop_life_us`` more."""
        p = self.p
        if p.crash_loop_at_us < 0 or self.now() < self.t0 + p.crash_loop_at_us:
            return
        if not self.looping:
            if not self.churning:
                return
            alive = [n for n in self.nodes.values() if n.alive]
            victim = max(alive, key=lambda n: (sum(1 for _ in n.core.owned_unfinished()), n.id))
            self.looping = victim.id
            self.loop_kill_at = self.step
        node = self.nodes[self.looping]
        if self.stats["crash_loop_kills"] >= p.crash_loop_kills:
            return
        if node.alive and self.loop_kill_at < 0:
            listed = self.looping in self.observer.members
            if self.observer.epoch > self.loop_epoch and listed:
                self.loop_kill_at = self.step + self.steps(p.crash_loop_life_us)
        if node.alive and 0 <= self.loop_kill_at <= self.step and self.churning:
            node.alive = False
            node.readers.clear()
            self.stats["crashes"] += 1
            self.stats["crash_loop_kills"] += 1
            self.loop_kill_at = -1
            self.loop_restart_at = self.step + self.steps(p.crash_loop_restart_us)
        elif not node.alive and 0 <= self.loop_restart_at <= self.step:
            self.loop_restart_at = -1
            self.loop_epoch = self.observer.epoch
            self.loop_first_generation = True
            back = self.start_node(self.looping)
            if p.crash_loop_leads:
                # its JoinGroup is the rebalance's first: it leads (the coordinator's choice)
                back.join_order = min(n.join_order for n in self.nodes.values()) - 1
            self.stats["restarts"] += 1

    def check_unread(self) -> None:
        """From ``crash_loop_at_us`` on: no live partition's watermark in the log stands still
        longer than ``unread_limit_us``."""
        start = self.t0 + self.p.crash_loop_at_us
        if self.p.crash_loop_at_us < 0 or self.now() < start:
            return
        first = self.steps(self.p.crash_loop_at_us)
        for token, info in self.model.partitions.items():
            if info.end_ts is not None or token in self.finished or token not in self.moved:
                continue
            stood = (self.step - max(self.moved[token], first)) * self.p.step_us
            self.max_unread = max(self.max_unread, stood)
            if 0 <= self.p.unread_limit_us < stood:
                raise Violation(
                    f"{token} unread for {stood / 1e6:.2f} s (its watermark in the log stood "
                    f"still since {(self.moved[token] * self.p.step_us) / 1e6:.2f} s; crash "
                    f"loop of {self.looping}: {self.stats['crash_loop_kills']} kills, "
                    f"{self.stats['yields']} yields, {self.stats['resets']} resets)"
                )

    # -- one step ------------------------------------------------------------------------------
    def learns_removal(self, node: _Node) -> bool:
        """A member the coordinator removed learns it only from the answer to its next request
        (``UNKNOWN_MEMBER_ID``): its next heartbeat, or its JoinGroup once it arrives; a lost
        JoinGroup times out and is sent again."""
        join = node.join
        if join is None:
            return (self.step - node.join_order) % self.steps(self.p.heartbeat_us) == 0
        arrive, timeout = join
        if arrive == -1:
            if self.step >= timeout:
                node.member.handle(JoinFailed(), self.now())
                self.send_join(node)
            return False
        return arrive <= self.step

    def tick(self, churn: bool) -> None:
        self.step += 1
        self.churning = churn
        if churn:
            self.faults()
        self.crash_loop()
        for due in [r for r in self.restarts if r[0] <= self.step]:
            self.restarts.remove(due)
            if not self.nodes[due[1]].alive:
                self.start_node(due[1])
                self.stats["restarts"] += 1
        self.land_messages()
        self.release_due()
        self.run_group()
        order = [n for n in self.nodes.values() if n.alive]
        self.rng.shuffle(order)
        for node in order:
            if node.paused(self.step):
                continue
            if node.expelled and node.id not in self.group and self.learns_removal(node):
                node.expelled = False
                # An expelled member never gets the assignments of the generations it missed.
                node.inbox = [e for e in node.inbox if not isinstance(e[2], Joined | _Assign)]
                heapq.heapify(node.inbox)
                self.handle(node, Lost("expelled"))
                self.enter_group(node)
            self.tick_due(node)
            self.read_log(node)
            while node.inbox and node.inbox[0][0] <= self.step:
                _, _, event = heapq.heappop(node.inbox)
                if isinstance(event, _Assign):
                    self.assign(node, event)
                elif isinstance(event, _Starting):
                    if node.starting.get(event.command.token) is event.command:
                        del node.starting[event.command.token]
                        self.start_reader(node, event.command)
                else:
                    self.handle(node, event)
            self.run_readers(node)
            self.flush_commits(node)
            self.tick_due(node)
        self.check()

    def release_due(self) -> None:
        """At ``release_at_us`` the sink heals (the conversion is fixed) and an operator's
        ``release`` of the quarantine the log shows is appended (again each step until the
        log shows the partition read again: a release of a quarantine not landed yet waits)."""
        if self.p.release_at_us < 0 or self.now() < self.t0 + self.p.release_at_us:
            return
        self.healed = True
        parked = self.parked()
        if parked is None or self.observer.releases.get(self.poison_token, -1) >= parked:
            return
        release = messages.ReleaseMessage(task_id="operator", token=self.poison_token, since=parked)
        self.log.append(release)
        self.observe(len(self.log) - 1, release)
        self.stats["releases"] += 1

    def parked(self) -> int | None:
        """The ``since`` of the poison partition's quarantine as the log shows it, if any."""
        if not self.poison_token:
            return None
        for _, part in self.observer.holders(self.poison_token):
            if part.quarantine is not None and part.status == "owned":
                return part.quarantine.since
        for _, offer in self.observer.offers():
            quarantine = offer.partition.quarantine
            if offer.token == self.poison_token and quarantine is not None:
                return quarantine.since
        return None

    def check_poison(self) -> None:
        """While the log shows the poison partition quarantined (not released), nobody reads
        it and the sink commits nothing of it past its watermark."""
        parked = self.parked()
        if parked is None:
            return
        if parked != self.quarantine_seen:
            self.quarantine_seen = parked
            self.stats["quarantined"] += 1
        if self.observer.releases.get(self.poison_token, -1) >= parked:
            return
        token = self.poison_token
        for node in self.nodes.values():
            if node.alive and self.active(node) and token in node.readers:
                raise Violation(f"{node.id} reads {token} while it is quarantined")
        durable = self.sink_tails.get(token)
        watermark = self.max_wm.get(token, 0)
        if durable is not None and durable.ts > max(watermark, self.poison_ts):
            raise Violation(
                f"the sink committed {token} to {durable.ts} past its quarantine's watermark "
                f"{watermark}"
            )

    def check(self) -> None:
        now = self.now()
        self.log_sizes.append(len(self.log))
        if len(self.log_sizes) == self.log_sizes.maxlen:
            rate = self.log_sizes[-1] - self.log_sizes[0]
            if rate > self.p.storm_limit:
                raise Violation(f"message storm: {rate} sync messages in one second")
        readers: dict[str, str] = {}
        owners: dict[str, str] = {}
        for node in self.nodes.values():
            if not node.alive:
                continue
            node.core.validate()
            node.member.validate()
            for reader in node.readers.values():
                reader.core.validate()
            if not self.active(node):
                continue
            for token in node.readers:
                if token in readers:
                    raise Violation(f"{readers[token]} and {node.id} both read {token}")
                readers[token] = node.id
            if node.core.may_read(now):
                for token in node.core.owned_unfinished():
                    if token in owners:
                        raise Violation(f"{owners[token]} and {node.id} both own {token}")
                    owners[token] = node.id
        if self.snapshot_plan is not None:
            self.check_snapshot_completeness()
        self.check_poison()
        self.check_unread()

    def check_snapshot_completeness(self) -> None:
        """The log's completeness watermark stays below T while a snapshot partition is not
        done, and reaches T only once every snapshot chunk is in the sink."""
        low = low_watermark(self.observer)
        if low is None or low < self.snapshot_ts:
            return
        state = self.observer.snapshot
        if not state.complete():
            raise Violation(
                f"completeness watermark {low} at or past the snapshot's T {self.snapshot_ts} "
                f"with {len(state.pending)} snapshot partitions not done"
            )
        missing = [
            r.identity
            for chunks in self.snapshot.values()
            for r in chunks
            if r.identity not in self.delivered
        ]
        if missing:
            raise Violation(
                f"completeness watermark {low} at or past the snapshot's T {self.snapshot_ts} "
                f"with {len(missing)} snapshot chunks not in the sink, e.g. {missing[0]}"
            )

    # -- the whole run -----------------------------------------------------------------------------
    def run(self) -> SimResult:
        for _ in range(self.p.tasks):
            self.start_node()
        for _ in range(self.steps(self.p.churn_us)):
            self.tick(churn=True)
        for node in self.nodes.values():
            if node.alive:
                node.paused_until = -1
        # What the paused tasks had sent waits for their old resume step; they resume now, so
        # it lands now, before anything they send next (one producer's messages stay in order).
        self.pending_log = [
            (min(land, self.step), seq, producer, payload)
            for land, seq, producer, payload in self.pending_log
        ]
        heapq.heapify(self.pending_log)
        # The quiet phase needs someone to read: at least one task, and with a cap enough
        # tasks for every partition. The cap rule: the surplus over the caps waits for other
        # tasks; add them now (as an operator would) and check the waiting partitions are
        # picked up and everything is read in the end.
        needed = 1
        if self.p.cap > 0:
            now = self.now()
            unread = sum(
                1
                for t, info in self.model.partitions.items()
                if t not in self.finished and info.start_ts <= now
            )
            needed = -(-unread // self.p.cap) + 1
        live = sum(1 for n in self.nodes.values() if n.alive)
        for _ in range(needed - live):
            self.start_node()
        for _ in range(self.steps(self.p.quiet_us)):
            self.tick(churn=False)
        self.final_checks()
        return SimResult(
            seed=self.p.seed,
            passed=True,
            steps=self.step,
            rebalances=self.stats["rebalances"],
            epochs=self.stats["epochs"],
            crashes=self.stats["crashes"],
            pauses=self.stats["pauses"],
            partitions=len(self.model.partitions),
            records=sum(1 for _ in self.delivered),
            duplicates=sum(self.delivered.values()) - len(self.delivered),
            append_failures=self.stats["append_failures"],
            resets=self.stats["resets"],
            read_on_answer=self.stats["read_on_answer"],
            sink_failures=self.stats["sink_failures"],
            fence_committed=self.stats["fence_committed"],
            snapshot_resumed=max(0, self.stats["snapshot_readers"] - len(self.snapshot)),
            snapshot_faults=self.stats["snapshot_faults"],
            snapshot_chunks=sum(
                1
                for chunks in self.snapshot.values()
                for r in chunks
                if r.identity in self.delivered
            ),
            quarantined=self.stats["quarantined"],
            poison_hops=len(self.poison_tasks),
            poison_failures=self.stats["poison_failures"],
            released_and_resumed=self.released_and_resumed(),
            yields=self.stats["yields"],
            crash_loop_kills=self.stats["crash_loop_kills"],
            max_unread_us=self.max_unread,
            loop_leaders_killed=self.stats["loop_leaders_killed"],
            holds_passed=self.stats["holds_passed"],
            claims_lost=sum(c.counters["announced_claims_lost"] for c in self.cores),
        )

    def released_and_resumed(self) -> bool:
        """The poison partition was released and its poison record reached the sink."""
        return self.stats["releases"] > 0 and self.poison in self.delivered

    def check_poison_end(self) -> bool:
        """The poison scenario's end: whether the poison partition is left parked (so it is
        exempt from being read and its records from the poison on from being delivered)."""
        if not self.poison_token:
            return False
        if self.poison is None:
            raise Violation(f"the poison partition {self.poison_token} never met its record")
        if self.stats["quarantined"] == 0:
            raise Violation(
                f"poison partition {self.poison_token} never quarantined: its batch failed "
                f"{self.stats['poison_failures']} times on {sorted(self.poison_tasks)}"
            )
        if self.p.release_at_us >= 0:
            if not self.released_and_resumed():
                raise Violation(f"poison partition {self.poison_token} not read again")
            return False
        return True

    def final_checks(self) -> None:
        now = self.now()
        live_nodes = [n for n in self.nodes.values() if n.alive]
        owners: dict[str, list[str]] = {}
        for node in live_nodes:
            for token in node.core.owned_unfinished():
                owners.setdefault(token, []).append(node.id)
        parked = self.check_poison_end()
        live_parts = [t for t, info in self.model.partitions.items() if info.end_ts is None]
        for token in live_parts:
            who = owners.get(token, [])
            if len(who) != 1:
                raise Violation(f"live partition {token} is owned by {who} at the end")
            if parked and token == self.poison_token:
                continue  # quarantined: nobody reads it
            if token not in self.nodes[who[0]].readers:
                raise Violation(f"live partition {token} owned by {who[0]} is not being read")
        if self.p.cap <= 0:
            loads = {n.id: sum(1 for _ in n.core.owned_unfinished()) for n in live_nodes}
            if max(loads.values()) - min(loads.values()) > 1:
                raise Violation(f"owned counts are not within one: {loads}")
        if self.snapshot_plan is not None and not self.observer.snapshot.complete():
            pending = sorted(self.observer.snapshot.pending)
            raise Violation(f"snapshot partitions not done at the end: {pending}")
        snapshot = {r.identity for chunks in self.snapshot.values() for r in chunks}
        horizon = now - 5_000_000
        expected = snapshot | {r.identity for r in self.model.expected(horizon)}
        if parked:  # the poison partition's records from the poison record on wait for it
            expected -= {
                r.identity
                for r in self.model.records(self.poison_token, self.poison_ts, horizon)
                if isinstance(r, DataChange)
            }
        missing = expected - set(self.delivered)
        if missing:
            raise Violation(f"{len(missing)} records never reached the sink, e.g. {min(missing)}")
        # every record the sink committed, to the last step: the stream committed it
        committed = snapshot | {r.identity for r in self.model.expected(now)}
        extra = set(self.delivered) - committed
        if extra:
            raise Violation(
                f"{len(extra)} records reached the sink that were never committed, e.g. "
                f"{min(extra)}"
            )
        twice = sorted(i for i, n in self.delivered.items() if n > 1)
        if twice:
            raise Violation(
                f"not exactly once: {len(twice)} records reached the sink more than once, e.g. "
                f"{twice[0]} {self.delivered[twice[0]]} times"
            )


def _invented(ts: int) -> DataChange:
    """A record no simulated stream commits (its transaction id is not of the model's form)."""
    return DataChange(
        commit_ts=ts,
        record_sequence="00000000",
        server_transaction_id="invented",
        is_last_record_in_transaction_in_partition=True,
        table="Invented",
        column_types=(),
        mods=(Mod('{"Id":"0"}', "{}", "{}"),),
        mod_type="INSERT",
    )


def plan_broken(*args: object, **kwargs: object) -> Plan:
    from protocol.broken import plan_moving_survivors

    return plan_moving_survivors(*args, **kwargs)  # type: ignore[arg-type]


def run(params: SimParams) -> SimResult:
    """Run one seed; a violated invariant comes back as a failed result naming the seed."""
    try:
        return Simulation(params).run()
    except AssertionError as exc:  # Violation, or a task core's own validate()
        return SimResult(seed=params.seed, passed=False, violation=str(exc))
