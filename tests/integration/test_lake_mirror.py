"""Mirror tables in Delta Lake (runtime/lake/mirror.py) with real delta-rs, on a local directory
and on moto's S3 server: the current state after inserts, full and partial updates and deletes;
two partitions' batches committed out of order (and the blind control that gets it wrong); a
batch applied twice, also after a SIGKILL; new columns; concurrent writers in two processes;
readers (deltalake, polars); and the cost of a batch as the table grows."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from protocol.mirror import mirror_changes
from protocol.records import ColumnType, DataChange, Mod
from runtime.lake.delta import DeltaCommitFailed, SchemaConflict
from runtime.lake.mirror import MirrorWriter, read_mirror
from runtime.lake.store import Store, open_store
from tests.fixtures.s3 import S3Server, s3_env, s3_server
from tests.helpers import REPO
from tests.mirror_model import COLUMNS, Database, Rows, blind, reference

__all__ = ["s3_env", "s3_server"]  # fixtures used by name

# the model database's table: a STRING key "Id", INT64 columns A, B, C
MODEL_TYPES = (
    ColumnType("Id", '{"code":"STRING"}', True, 1),
    *(ColumnType(c, '{"code":"INT64"}', False, i + 2) for i, c in enumerate(COLUMNS)),
)


@dataclass(frozen=True)
class Lake:
    store: Store
    env: dict[str, str]  # for subprocesses

    def rows(self, table: str) -> Rows:
        """What a reader of the mirror sees, as the model's rows."""
        return as_rows(table, read_mirror(self.store, table))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def lake(request: pytest.FixtureRequest, tmp_path: Path) -> Lake:
    if request.param == "file":
        return Lake(open_store(tmp_path / "mirror"), {**os.environ, "PYTHONPATH": str(REPO)})
    server: S3Server = request.getfixturevalue("s3_env")
    store = open_store(server.uri(f"mirror-{uuid.uuid4().hex[:8]}"))
    return Lake(store, server.child_env(PYTHONPATH=str(REPO)))


def as_rows(table: str, data: pa.Table) -> Rows:
    out: Rows = {}
    for row in data.to_pylist():
        key = row.pop("Id")
        out[(table, (("Id", key),))] = {c: v for c, v in row.items() if v is not None}
    return out


def model_rows(rows: Rows) -> Rows:
    """The model's rows with null columns left out (as :func:`as_rows` reads them)."""
    return {rid: {c: v for c, v in r.items() if v is not None} for rid, r in rows.items()}


def typed(records: Sequence[DataChange]) -> list[DataChange]:
    """The model's records with their table's column types (as Spanner sends them)."""
    return [msgspec.structs.replace(r, column_types=MODEL_TYPES) for r in records]


def history(
    seed: int, capture: str, txns: int = 60, keys: int = 12
) -> tuple[Database, list[DataChange]]:
    """A random run of transactions on table T of the model database, and its records."""
    rng = random.Random(seed)
    db = Database(capture, keys=keys)
    records: list[DataChange] = []
    for n in range(txns):
        ops = [
            (0, rng.randrange(keys), rng.randrange(3), rng.randrange(1, 8), rng.randrange(1, 50))
            for _ in range(rng.randrange(1, 4))
        ]
        records += typed(db.commit(100 + n, ops))
    return db, records


def chunks(records: Sequence[DataChange], size: int) -> list[list[DataChange]]:
    """``records`` cut into batches of about ``size``, never inside a transaction."""
    out: list[list[DataChange]] = [[]]
    for r in records:
        last = out[-1]
        if len(last) >= size and last[-1].commit_ts != r.commit_ts:
            out.append(last := [])
        last.append(r)
    return out


# --- in process ------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", ["OLD_AND_NEW_VALUES", "NEW_VALUES", "NEW_ROW"])
def test_inserts_updates_deletes_give_the_current_state(lake: Lake, capture: str) -> None:
    """Random transactions (inserts, full or partial updates, deletes), merged batch by batch:
    after every batch the mirror shows the database's rows as of that batch's last commit."""
    db, records = history(1, capture)
    writer = MirrorWriter(lake.store)
    app = f"shoal/test/{uuid.uuid4().hex[:8]}"
    for version, batch in enumerate(chunks(records, 7), start=1):
        result = writer.apply_batch("T", batch, app=app, version=version)
        assert not result.already
        assert lake.rows("T") == model_rows(db.at(batch[-1].commit_ts))
    dt = DeltaTable(lake.store.uri_for("T"), storage_options=lake.store.storage_options())
    assert dt.transaction_version(app) == len(chunks(records, 7))
    # deleted rows are kept as tombstones, hidden from readers
    everything = read_mirror(lake.store, "T", tombstones=True)
    assert set(everything.column_names) >= {"_mirror_key", "_deleted", "_commit_ts"}
    tombstones = everything.filter(everything.column("_deleted")).column("Id").to_pylist()
    assert set(tombstones).isdisjoint(k[0][1] for _, k in db.rows)
    keys = everything.column("_mirror_key").to_pylist()
    assert len(keys) == len(set(keys))  # one row per key


def test_out_of_order_partitions_leave_the_mirror_right(lake: Lake) -> None:
    """A partition split moves the keys to a child partition half-way: the child's batches
    commit before the parent's older ones. The mirror still equals the database; the blind
    control (each change applied in commit order, as a plain upsert would) does not."""
    db, records = history(7, "OLD_AND_NEW_VALUES", txns=80)
    parent = [r for r in records if r.commit_ts < 140]
    child = [r for r in records if r.commit_ts >= 140]
    committed = chunks(child, 9) + chunks(parent, 9)  # the child's batches first
    writer = MirrorWriter(lake.store)
    for version, batch in enumerate(committed, start=1):
        writer.apply_batch("T", batch, app="shoal/test/w", version=version)
    assert lake.rows("T") == model_rows(db.rows)
    assert model_rows(reference(mirror_changes(records))) == model_rows(db.rows)
    # control: the same batches applied blindly in commit order are wrong
    in_commit_order = [r for batch in committed for r in batch]
    assert model_rows(blind(in_commit_order)) != model_rows(db.rows)


def test_a_batch_applied_twice_changes_nothing(lake: Lake) -> None:
    db, records = history(3, "NEW_VALUES")
    writer = MirrorWriter(lake.store)
    batches = chunks(records, 10)
    for version, batch in enumerate(batches, start=1):
        writer.apply_batch("T", batch, app="shoal/test/a", version=version)
    dt = DeltaTable(lake.store.uri_for("T"), storage_options=lake.store.storage_options())
    table_version = dt.version()
    # the same identity again: nothing is written at all
    again = writer.apply_batch("T", batches[2], app="shoal/test/a", version=3)
    assert again.already
    dt.update_incremental()
    assert dt.version() == table_version
    # under a new identity (a recovery that lost it): the core finds every change stale
    fresh = writer.apply_batch("T", batches[2], app="shoal/test/b", version=1)
    assert (fresh.already, fresh.stale, fresh.upserts + fresh.tombstones) == (
        False,
        fresh.mods,
        0,
    )
    assert lake.rows("T") == model_rows(db.rows)


def test_new_columns_merge_into_the_schema(lake: Lake) -> None:
    """A column added to the Spanner table: the first batch that carries it adds it to the
    mirror (older rows read null); a column whose type changed is refused."""
    writer = MirrorWriter(lake.store)
    key = ColumnType("K", '{"code":"INT64"}', True, 1)
    name = ColumnType("Name", '{"code":"STRING"}', False, 2)
    when = ColumnType("When", '{"code":"TIMESTAMP"}', False, 3)

    def rec(ts: int, cols: tuple[ColumnType, ...], k: int, values: dict[str, Any]) -> DataChange:
        mod = Mod(json.dumps({"K": str(k)}), json.dumps(values), "{}")
        return DataChange(ts, "0", f"t{ts}", True, "S", cols, (mod,), "INSERT")

    writer.apply_batch("S", [rec(1, (key, name), 1, {"Name": "a"})], app="a", version=1)
    result = writer.apply_batch(
        "S",
        [rec(2, (key, name, when), 2, {"Name": "b", "When": "2024-02-29T12:00:00.5Z"})],
        app="a",
        version=2,
    )
    assert result.columns_added == ("When",)
    rows = sorted(read_mirror(lake.store, "S").to_pylist(), key=lambda r: r["K"])
    assert [(r["K"], r["Name"], r["When"] and r["When"].isoformat()) for r in rows] == [
        (1, "a", None),
        (2, "b", "2024-02-29T12:00:00.500000+00:00"),
    ]
    bad = ColumnType("Name", '{"code":"INT64"}', False, 2)
    with pytest.raises(SchemaConflict, match="column Name"):
        writer.apply_batch("S", [rec(3, (key, bad), 3, {"Name": "7"})], app="a", version=3)


def test_every_type_round_trips(lake: Lake) -> None:
    """Every Spanner type, a composite key, a partial update of a row: the values read back
    are the typed changelog's, and the partial update keeps the other columns."""
    types = {
        "Int": '{"code":"INT64"}',
        "F64": '{"code":"FLOAT64"}',
        "F32": '{"code":"FLOAT32"}',
        "Num": '{"code":"NUMERIC"}',
        "Str": '{"code":"STRING"}',
        "Js": '{"code":"JSON"}',
        "By": '{"code":"BYTES"}',
        "Bo": '{"code":"BOOL"}',
        "Da": '{"code":"DATE"}',
        "Ts": '{"code":"TIMESTAMP"}',
        "Arr": '{"array_element_type":{"code":"TIMESTAMP"},"code":"ARRAY"}',
    }
    cols = (
        ColumnType("A", '{"code":"STRING"}', True, 1),
        ColumnType("B", '{"code":"INT64"}', True, 2),
        *(ColumnType(n, t, False, i + 3) for i, (n, t) in enumerate(types.items())),
    )
    values = {
        "Int": "9007199254740993",
        "F64": "NaN",
        "F32": 1.5,
        "Num": "12345.000000001",
        "Str": "x",
        "Js": '{"a": [1, 2]}',
        "By": "AAEC",
        "Bo": True,
        "Da": "2024-02-29",
        "Ts": "2024-01-02T03:04:05.123456Z",
        "Arr": ["2024-01-01T00:00:00Z", None],
    }
    keys = json.dumps({"A": "k", "B": "-5"})
    insert = DataChange(
        10, "0", "t1", True, "E", cols, (Mod(keys, json.dumps(values), "{}"),), "INSERT"
    )
    update = DataChange(
        20, "0", "t2", True, "E", cols, (Mod(keys, json.dumps({"Str": "y"}), "{}"),), "UPDATE"
    )
    writer = MirrorWriter(lake.store)
    writer.apply_batch("E", [update], app="a", version=1)  # the newer partial update first
    writer.apply_batch("E", [insert], app="a", version=2)
    [row] = read_mirror(lake.store, "E").to_pylist()
    assert (row["A"], row["B"], row["Int"], row["F32"]) == ("k", -5, 9007199254740993, 1.5)
    assert row["F64"] != row["F64"]  # NaN
    assert str(row["Num"]) == "12345.000000001"
    assert (row["Str"], row["Js"], row["By"], row["Bo"]) == ("y", '{"a": [1, 2]}', b"\0\1\2", True)
    assert row["Da"].isoformat() == "2024-02-29"
    assert row["Ts"].isoformat() == "2024-01-02T03:04:05.123456+00:00"
    assert [t and t.isoformat() for t in row["Arr"]] == ["2024-01-01T00:00:00+00:00", None]
    # a further partial update reads the row back (every type) and writes it again
    later = DataChange(
        30, "0", "t3", True, "E", cols, (Mod(keys, json.dumps({"Bo": False}), "{}"),), "UPDATE"
    )
    writer.apply_batch("E", [later], app="a", version=3)
    [again] = read_mirror(lake.store, "E").to_pylist()
    assert again["Bo"] is False
    assert {k: v for k, v in again.items() if k not in ("Bo", "F64")} == {
        k: v for k, v in row.items() if k not in ("Bo", "F64")
    }


def test_readers_see_the_database_rows(lake: Lake) -> None:
    pl = pytest.importorskip("polars")
    db, records = history(5, "OLD_AND_NEW_VALUES")
    writer = MirrorWriter(lake.store)
    for version, batch in enumerate(chunks(records, 20), start=1):
        writer.apply_batch("T", batch, app="a", version=version)
    uri = lake.store.uri_for("T")
    options = lake.store.storage_options()
    frame = pl.read_delta(uri, storage_options=options or None)
    live = frame.filter(~pl.col("_deleted")).select(["Id", *COLUMNS])
    assert as_rows("T", live.to_arrow()) == model_rows(db.rows)
    data = DeltaTable(uri, storage_options=options).to_pyarrow_table(
        columns=["Id", *COLUMNS], filters=[("_deleted", "=", False)]
    )
    assert as_rows("T", pa.table(data)) == model_rows(db.rows)


# --- subprocesses ----------------------------------------------------------------------------


def proc(lake: Lake, batches: Path, app: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.proc_mirror_apply",
            lake.store.uri,
            "T",
            app,
            str(batches),
            *args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=lake.env,
    )


def lines(stream: IO[str] | None) -> Iterator[dict[str, Any]]:
    assert stream is not None
    for line in stream:
        yield json.loads(line)


def finish(p: subprocess.Popen[str], expect_rc: int = 0) -> list[dict[str, Any]]:
    out, err = p.communicate(timeout=240)
    assert p.returncode == expect_rc, err
    return [json.loads(line) for line in out.splitlines()]


def save(path: Path, batches: list[list[DataChange]]) -> Path:
    path.write_bytes(msgspec.json.encode(batches))
    return path


def test_sigkill_after_commit_then_retry_changes_nothing(lake: Lake, tmp_path: Path) -> None:
    db, records = history(11, "OLD_AND_NEW_VALUES")
    batches = save(tmp_path / "b.json", chunks(records, 8))
    out = finish(proc(lake, batches, "app", "--kill-after", "3"), -signal.SIGKILL)
    assert [o["batch"] for o in out if "batch" in o] == [1, 2]  # 3 committed, never confirmed
    out = finish(proc(lake, batches, "app", "--first", "3"))
    done = [(o["batch"], o["already"]) for o in out if "batch" in o]
    assert done[0] == (3, True)
    assert not any(a for _, a in done[1:])
    assert lake.rows("T") == model_rows(db.rows)


def test_sigkill_between_a_merges_files_and_its_commit(tmp_path: Path) -> None:
    """A writer whose merge wrote its data files but could not commit (a directory stands where
    its commit file must go) is SIGKILLed: nothing of the batch is visible, its files are
    garbage for vacuum, and the rerun merges the batch once. Local directory (the blocker is a
    directory in it)."""
    lake = Lake(open_store(tmp_path / "mirror"), {**os.environ, "PYTHONPATH": str(REPO)})
    cols = (
        ColumnType("Id", '{"code":"INT64"}', True, 1),
        ColumnType("V", '{"code":"STRING"}', False, 2),
    )

    def batch(ts: int, ids: range) -> list[DataChange]:
        mods = tuple(
            Mod(json.dumps({"Id": str(i)}), json.dumps({"V": f"v{ts}-{i}"}), "{}") for i in ids
        )
        return [DataChange(ts, "0", f"t{ts}", True, "T", cols, mods, "INSERT")]

    batches = [batch(10, range(1000)), batch(20, range(0, 2000, 2))]
    path = save(tmp_path / "b.json", batches)
    table_dir = tmp_path / "mirror" / "T"
    out = finish(proc(lake, path, "app", "--block-commit", "2"), -signal.SIGKILL)
    blocked = [o for o in out if "blocked" in o]
    assert blocked, out
    dt = DeltaTable(str(table_dir))
    committed = {a["path"] for a in pa.table(dt.get_add_actions(flatten=True)).to_pylist()}
    orphans = set(blocked[0]["files"]) - committed
    assert orphans  # the merge's data files are there ...
    assert dt.transaction_version("app") == 1  # ... but not its commit
    assert {r["Id"]: r["V"] for r in read_mirror(lake.store, "T").to_pylist()} == _values(
        batches[0]
    )
    garbage = dt.vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=True, full=True
    )
    assert orphans <= {Path(g).name for g in garbage}
    (table_dir / "_delta_log" / f"{dt.version() + 1:020d}.json").rmdir()
    out = finish(proc(lake, path, "app", "--first", "2"))
    assert [(o["batch"], o["already"]) for o in out if "batch" in o] == [(2, False)]
    after = {r["Id"]: r["V"] for r in read_mirror(lake.store, "T").to_pylist()}
    assert after == {**_values(batches[0]), **_values(batches[1])}
    again = finish(proc(lake, path, "app", "--first", "2"))
    assert [(o["batch"], o["already"]) for o in again if "batch" in o] == [(2, True)]


def _values(batch: list[DataChange]) -> dict[int, str]:
    return {
        int(json.loads(m.keys)["Id"]): json.loads(m.new_values)["V"] for r in batch for m in r.mods
    }


def test_two_processes_merge_into_one_table_concurrently(lake: Lake, tmp_path: Path) -> None:
    """Two writers (processes, own app ids) merge the batches of two partitions into one
    table at once; a split moved half the keys from the first partition to the second half-way,
    so both write some rows: conflicts are retried and the mirror equals the database."""
    db, records = history(13, "OLD_AND_NEW_VALUES", txns=120, keys=40)
    moved = {str(k) for k in range(0, 40, 2)}

    def partition(r: DataChange) -> int:
        key = json.loads(r.mods[0].keys)["Id"]
        return 1 if r.commit_ts >= 160 and key in moved else 0

    parts: list[list[DataChange]] = [[], []]
    for r in records:  # one record per key run: split records by their mods' partitions
        for m in r.mods:
            one = msgspec.structs.replace(r, mods=(m,))
            parts[partition(one)].append(one)
    files = [save(tmp_path / f"p{i}.json", chunks(part, 6)) for i, part in enumerate(parts)]
    procs = [proc(lake, f, f"app{i}", "--wait-stdin") for i, f in enumerate(files)]
    for p in procs:
        assert next(lines(p.stdout)) == {"ready": True}
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [finish(p) for p in procs]
    assert lake.rows("T") == model_rows(db.rows)
    attempts = [o["attempts"] for out in outs for o in out if "batch" in o]
    everything = read_mirror(lake.store, "T", tombstones=True)
    keys = everything.column("_mirror_key").to_pylist()
    assert len(keys) == len(set(keys))
    print(f"retried attempts: {sum(a - 1 for a in attempts)} over {len(attempts)} batches")


class _Interleaved(MirrorWriter):
    """A writer that lets another writer commit a batch right after it read the touched rows
    (once): the race of two processes, made deterministic."""

    def __init__(self, store: Store, other: MirrorWriter, batch: list[DataChange], **kw: Any):
        super().__init__(store, **kw)
        self.other, self.batch = other, batch

    def current(self, dt: DeltaTable, table: str, keys: Sequence[str], ranges: Any = ()) -> Any:
        found = super().current(dt, table, keys, ranges)
        if self.batch:
            batch, self.batch = self.batch, []
            self.other.apply_batch(table, batch, app=f"other-{uuid.uuid4().hex}", version=1)
        return found


@pytest.mark.parametrize("serialize", [True, False])
def test_a_merge_that_raced_another_is_retried(tmp_path: Path, serialize: bool) -> None:
    """Writer A reads the rows its batch touches (none: its key is new); writer B commits a
    batch inserting the same key; then A merges. A's commit must fail and be retried over B's
    row: one row, the newest values. delta-rs 1.6 fails such a merge by itself (``serialize``
    off); the shared application id makes it not depend on how delta-rs scopes a merge's reads.
    Control: with a single attempt the race surfaces as DeltaCommitFailed and B's row stays."""
    store = open_store(tmp_path / "mirror")
    cols = (
        ColumnType("Id", '{"code":"INT64"}', True, 1),
        ColumnType("V", '{"code":"STRING"}', False, 2),
    )

    def rec(ts: int, values: dict[int, str]) -> DataChange:
        mods = tuple(
            Mod(json.dumps({"Id": str(k)}), json.dumps({"V": v}), "{}") for k, v in values.items()
        )
        return DataChange(ts, "0", f"t{ts}", True, "T", cols, mods, "INSERT")

    MirrorWriter(store).apply_batch("T", [rec(1, {1: "a", 2: "b"})], app="seed", version=1)
    other = MirrorWriter(store, serialize=serialize)
    once = _Interleaved(store, other, [rec(30, {3: "new-late"})], serialize=serialize, retries=1)
    with pytest.raises(DeltaCommitFailed):
        once.apply_batch("T", [rec(20, {3: "new-early"})], app="once", version=1)
    assert {r["Id"]: r["V"] for r in read_mirror(store, "T").to_pylist()} == {
        1: "a",
        2: "b",
        3: "new-late",
    }
    racer = _Interleaved(store, other, [rec(40, {4: "new-late"})], serialize=serialize)
    result = racer.apply_batch(
        "T", [rec(20, {3: "new-early"}), rec(35, {4: "new-early"})], app="racer", version=1
    )
    assert result.attempts == 2
    everything = read_mirror(store, "T", tombstones=True)
    keys = everything.column("_mirror_key").to_pylist()
    assert len(keys) == len(set(keys)) == 4
    rows = {r["Id"]: r["V"] for r in read_mirror(store, "T").to_pylist()}
    assert rows == {1: "a", 2: "b", 3: "new-late", 4: "new-late"}


def test_a_batch_reads_only_the_files_that_can_hold_its_keys(tmp_path: Path) -> None:
    """Ten batches of 500 new ascending ids make ten files, each a key range; a batch updating
    100 ids of one range reads one file (the others' statistics cannot hold its keys) and
    delta-rs rewrites only that file's rows. Control: a batch with one id in each range reads
    every file."""
    store = open_store(tmp_path / "mirror")
    cols = (
        ColumnType("Id", '{"code":"INT64"}', True, 1),
        ColumnType("V", '{"code":"STRING"}', False, 2),
    )

    def rec(ts: int, mod_type: str, ids: Sequence[int]) -> DataChange:
        mods = tuple(Mod(json.dumps({"Id": str(i)}), json.dumps({"V": f"{ts}"}), "{}") for i in ids)
        return DataChange(ts, "0", f"t{ts}", True, "T", cols, mods, mod_type)  # type: ignore[arg-type]

    writer = MirrorWriter(store)
    for b in range(10):
        writer.apply_batch(
            "T", [rec(b + 1, "INSERT", range(b * 500, b * 500 + 500))], app="a", version=b + 1
        )
    result = writer.apply_batch("T", [rec(20, "UPDATE", range(3100, 3200))], app="a", version=11)
    assert (result.files_read, result.files_total, result.rows_read) == (1, 10, 100)
    dt = DeltaTable(store.uri_for("T"))
    metrics = dt.history(1)[0]["operationMetrics"]
    assert metrics["num_target_rows_copied"] == 400  # the rest of that one file
    spread = writer.apply_batch(
        "T", [rec(21, "UPDATE", range(250, 5000, 500))], app="a", version=12
    )
    assert (spread.files_read, spread.rows_read) == (spread.files_total, 10)
    rows = {r["Id"]: r["V"] for r in read_mirror(store, "T").to_pylist()}
    assert len(rows) == 5000
    assert {i: rows[i] for i in (0, 3099, 3100, 3199, 3250, 3200)} == {
        0: "1",
        3099: "7",
        3100: "20",
        3199: "20",
        3250: "21",
        3200: "7",
    }
