"""``SpannerSource``: the ``ChangeStreamSource`` port over a real Spanner change stream.

Each ``query(token, start_ts, end_ts)`` runs

    SELECT ChangeRecord FROM READ_<stream>(start_timestamp => @start, end_timestamp => @end,
        partition_token => @token, heartbeat_milliseconds => @hb)

in a single-use strong read-only snapshot on the asyncio client
(``google.cloud.spanner_v1.AsyncClient``, experimental in google-cloud-spanner 3.71, which
pyproject pins) with ``lazy_decode=True``; every partial result set the server sends is decoded by
``runtime.spanner.decode`` and yielded at once as one or more batches of at most ``max_batch``
records. ``token=None`` gives the root partitions as one ``ChildPartitions`` record.

PostgreSQL-dialect databases: ``detect_dialect()`` (the CLI calls it on connecting) asks the
database its dialect; a PostgreSQL one is then read with

    SELECT * FROM spanner."read_json_<stream>"($1, $2, $3, $4, null)

(the same four arguments, positional), whose JSONB rows ``runtime.spanner.decode`` turns into the
same records; which decoder runs follows the result set's column type.

- Backpressure: nothing is read from the gRPC stream while the consumer holds a batch.
- Cancellation: cancelling the consuming task cancels the RPC (grpc.aio does that on
  cancellation); closing the iterator early (``aclose()``) closes the client's response iterator,
  which drops and so cancels the call. No threads are involved.
- Windows (``query_window_s``): a partition query asks for at most that span of commit time;
  when it ends without ``ChildPartitions`` (the partition lives on) the source goes on with the
  next window from one microsecond after the newest timestamp the query itself vouched for (its
  last heartbeat or record; a query that vouched for nothing ends its window with a ``Heartbeat``
  at the window's end, which is inclusive), so the consumer sees one unbroken stream. Why: the Cloud Spanner emulator keeps running a cancelled query's server loop
  until its end timestamp or the partition's end (measured: ~0.015 cores per cancelled query on
  an idle stream, more as data grows; 120 cancelled queries kept 1.8 cores busy). A reader that
  restarts queries on a long-lived partition (a hand-off, a lapsed lease, a stall) then starves
  the emulator, whose other queries go silent for tens of seconds, which causes more restarts.
  A window bounds each leaked loop to its span. Real Spanner cancels on the server; there the
  window only costs one new query per span per partition.
- Trailing (``trail_s``, on against the emulator only): every partition query asks for a window
  that has already ended, at least ``trail_s`` before the query is sent, and the source polls
  (a new query every ``trail_s``) once it has caught up. Why: the emulator's live partition
  query scans its change-stream table in 100 ms steps, ``[start, end)`` then
  ``[end + 1 µs, ...)``, so a commit whose timestamp is exactly a step's end is never returned
  (its ``frontend/handlers/change_streams.cc``; measured: a plain live query with 2 ms steps
  missed 3 of 7,935 commits that a query over the past returned, and with the default 100 ms
  steps chaos runs lost a transaction now and then). A query whose end is already past is
  answered in one inclusive step, complete. Each such query ends with a ``Heartbeat`` at its
  end (it returned everything up to it), so the consumer sees one unbroken stream. Spanner has
  no such gap; there the source reads live.
- Errors: UNAVAILABLE and resumable INTERNAL errors are retried inside the client with resume
  tokens. Everything else surfaces as ``PartitionQueryError`` (``retryable=True`` for errors from
  the service, ``False`` for records this decoder cannot read); the reader actor restarts the
  partition from its watermark with backoff and drops duplicates. Errors no retry can mend
  (:data:`FATAL_CODES`: PERMISSION_DENIED, NOT_FOUND, UNAUTHENTICATED, INVALID_ARGUMENT — a wrong
  database or change stream, one that was dropped, missing permissions) surface as
  ``ChangeStreamUnreadable``, an :class:`~runtime.ports.Unrecoverable` that stops the process
  with a message naming Spanner and the code; UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, INTERNAL
  and anything else are retried (:func:`status_name`).

MUTABLE_KEY_RANGE streams (``partition_mode``, learnt by :meth:`SpannerSource.stream_options`
or given as ``mutable=True``): the same query answers one ``PROTO`` column, decoded by
``runtime.spanner.mutable_decode`` (which decoder runs follows the result set's column type);
every query, the root's too, ends at most 30 minutes after its start (``protocol.mutable``,
``query_end``), the next going on from there as with windows, until the partition end record.

``walk_stream`` reads a whole time range following child partitions (a merged child once, after
all its parents finished): tests and the benchmark use it; production partition scheduling is the
actors' business.

Uses private parts of the client (3.71), through :mod:`runtime.compat`, which checks the installed
version so an upgrade fails loudly, not silently: the result set's ``_response_iterator`` (the
resuming stream of ``PartialResultSet``s, consumed directly: one partial result set is one batch,
and the client's per-value Python row loop is skipped), ``_async.streamed._merge_by_type`` (to
join chunked values), and the gRPC call in a suspended generator's frame (to cancel a query whose
consumer stopped early).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Final

import msgspec

from protocol.mutable import MAX_QUERY_SPAN_US, PartitionEnd, query_end
from protocol.records import ChangeRecord, ChildPartitions, DataChange, Heartbeat
from protocol.stream_options import StreamOptions, stream_options
from runtime import compat
from runtime.ports import ChangeStreamSource, Unrecoverable
from runtime.spanner.config import SpannerConfig
from runtime.spanner.decode import (
    DecodeError,
    PgRecordDecoder,
    RecordLayout,
    count_default_decoded,
)
from runtime.spanner.mutable_decode import MutableRecordDecoder

__all__ = [
    "FATAL_CODES",
    "GOOGLE_SQL",
    "POSTGRESQL",
    "ChangeStreamUnreadable",
    "PartitionQueryError",
    "SourceStats",
    "SpannerSource",
    "UnsupportedDialect",
    "WalkResult",
    "change_stream_sql",
    "detect_dialect",
    "micros_to_datetime",
    "walk_stream",
]

log = logging.getLogger(__name__)

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def micros_to_datetime(micros: int) -> _dt.datetime:
    return _EPOCH + _dt.timedelta(microseconds=micros)


class PartitionQueryError(RuntimeError):
    """A partition query failed with an error the client does not retry itself."""

    def __init__(
        self, token: str | None, start_ts: int, message: str, *, retryable: bool = True
    ) -> None:
        super().__init__(f"change-stream query of partition {token!r} from {start_ts}: {message}")
        self.token = token
        self.start_ts = start_ts
        self.retryable = retryable


# gRPC status codes of a query error that retrying cannot mend: the process stops.
FATAL_CODES = frozenset({"PERMISSION_DENIED", "NOT_FOUND", "UNAUTHENTICATED", "INVALID_ARGUMENT"})


class ChangeStreamUnreadable(PartitionQueryError, Unrecoverable):
    """A partition query failed with a status in :data:`FATAL_CODES`: the database, the change
    stream or the permissions are wrong, and every retry would fail the same way."""

    def __init__(self, token: str | None, start_ts: int, code: str, detail: str) -> None:
        RuntimeError.__init__(
            self,
            f"Spanner: the change-stream query failed with {code}, which retrying cannot mend "
            f"(a wrong or dropped database or change stream, or missing permissions): {detail}",
        )
        self.token = token
        self.start_ts = start_ts
        self.retryable = False
        self.code = code


def status_name(exc: BaseException) -> str | None:
    """The gRPC status code name of a client error (``google.api_core`` exceptions carry it as
    ``grpc_status_code``, raw gRPC errors answer ``code()``), or None."""
    code = getattr(exc, "grpc_status_code", None)
    if code is None:
        method = getattr(exc, "code", None)
        if callable(method):
            try:
                code = method()
            except Exception:  # an object whose code() needs arguments: not a gRPC error
                log.debug("no gRPC status on %r", exc, exc_info=True)
                return None
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else None


class UnsupportedDialect(RuntimeError):
    """The database's dialect is neither GoogleSQL nor PostgreSQL, or its change stream is not
    there: the message says which."""


GOOGLE_SQL: Final = "GOOGLE_STANDARD_SQL"
POSTGRESQL: Final = "POSTGRESQL"

# The dialect, asked in SQL both dialects read alike (PostgreSQL folds the unquoted names to
# the lower case its information schema uses); no admin permission needed, unlike GetDatabase.
_DIALECT_SQL = (
    "SELECT OPTION_VALUE FROM INFORMATION_SCHEMA.DATABASE_OPTIONS "
    "WHERE OPTION_NAME = 'database_dialect'"
)
_STREAMS_SQL = "SELECT CHANGE_STREAM_NAME FROM INFORMATION_SCHEMA.CHANGE_STREAMS"
# the tables a GoogleSQL change stream watches: all of them (FOR ALL), or those it names
_WATCHES_ALL_SQL = (
    "SELECT `ALL` FROM INFORMATION_SCHEMA.CHANGE_STREAMS WHERE CHANGE_STREAM_NAME = @stream"
)
_ALL_TABLES_SQL = (
    "SELECT TABLE_NAME FROM INFORMATION_SCHEMA.TABLES "
    "WHERE TABLE_SCHEMA = '' AND TABLE_TYPE = 'BASE TABLE'"
)
_STREAM_TABLES_SQL = (
    "SELECT TABLE_NAME FROM INFORMATION_SCHEMA.CHANGE_STREAM_TABLES "
    "WHERE CHANGE_STREAM_NAME = @stream"
)


_OPTIONS_SQL = (
    "SELECT OPTION_NAME, OPTION_VALUE FROM INFORMATION_SCHEMA.CHANGE_STREAM_OPTIONS "
    "WHERE CHANGE_STREAM_NAME = @stream"
)
_PG_OPTIONS_SQL = (
    "SELECT option_name, option_value FROM information_schema.change_stream_options "
    "WHERE change_stream_name = $1"
)


def change_stream_sql(dialect: str, change_stream: str) -> str:
    """The partition query of ``change_stream`` in ``dialect``: GoogleSQL's ``READ_<stream>``
    with named parameters, or PostgreSQL's ``spanner."read_json_<stream>"`` with positional
    ones (start, end, token, heartbeat ms, and a reserved null). The PostgreSQL function name is
    quoted, so it must be spelt as the database stores it (``detect_dialect`` resolves it)."""
    if dialect == POSTGRESQL:
        return f'SELECT * FROM spanner."read_json_{change_stream}"($1, $2, $3, $4, null)'
    return (
        f"SELECT ChangeRecord FROM READ_{change_stream}(start_timestamp => @start, "
        "end_timestamp => @end, partition_token => @token, heartbeat_milliseconds => @hb)"
    )


async def detect_dialect(database: Any, name: str, change_stream: str) -> tuple[str, str]:
    """The database's dialect (:data:`GOOGLE_SQL` or :data:`POSTGRESQL`) and, for PostgreSQL,
    the change stream's name as the database stores it: PostgreSQL folds unquoted names to lower
    case (``CREATE CHANGE STREAM Orders`` makes ``orders``), so a name given in another case is
    matched case-insensitively when exactly one stream matches. A dialect that cannot be asked
    (a role without access to the information schema) is assumed to be GoogleSQL.
    Raises :class:`UnsupportedDialect` for any other dialect."""
    try:
        async with database.snapshot() as snapshot:
            rs = await snapshot.execute_sql(_DIALECT_SQL)
            rows = [row async for row in rs]
    except _service_errors() as exc:
        log.info("could not ask database %s for its dialect (%s); assuming GoogleSQL", name, exc)
        return GOOGLE_SQL, change_stream
    dialect = str(rows[0][0]).upper() if rows else GOOGLE_SQL
    if dialect == GOOGLE_SQL:
        return dialect, change_stream
    if dialect != POSTGRESQL:
        raise UnsupportedDialect(
            f"database {name!r} has dialect {dialect}: shoal reads GoogleSQL and PostgreSQL "
            "change streams only"
        )
    try:
        async with database.snapshot() as snapshot:
            rs = await snapshot.execute_sql(_STREAMS_SQL)
            streams = [str(row[0]) async for row in rs]
    except _service_errors() as exc:
        log.info("could not list the change streams of %s (%s)", name, exc)
        return dialect, change_stream
    if change_stream in streams:
        return dialect, change_stream
    folded = [s for s in streams if s.lower() == change_stream.lower()]
    if len(folded) == 1:
        log.info("change stream %r of %s is stored as %r", change_stream, name, folded[0])
        return dialect, folded[0]
    raise UnsupportedDialect(
        f"PostgreSQL-dialect database {name!r} has no change stream {change_stream!r} "
        f"(it has {sorted(streams) or 'none'}); names are case-sensitive as stored"
    )


class SourceStats(msgspec.Struct, frozen=True):
    queries_started: int
    queries_active: int
    queries_failed: int
    batches: int
    records: int
    decode_seconds: float
    windows: int = 0  # partition queries continued past a query window's end


def _request_options(rpc_priority: str | None) -> Any:
    """``RequestOptions`` with the priority of the change-stream queries (None: unset)."""
    if rpc_priority is None:
        return None
    from google.cloud.spanner_v1 import RequestOptions

    priorities = {
        "LOW": RequestOptions.Priority.PRIORITY_LOW,
        "MEDIUM": RequestOptions.Priority.PRIORITY_MEDIUM,
        "HIGH": RequestOptions.Priority.PRIORITY_HIGH,
    }
    if rpc_priority not in priorities:
        raise ValueError(f"rpc_priority must be LOW, MEDIUM or HIGH, got {rpc_priority!r}")
    return RequestOptions(priority=priorities[rpc_priority])


def _service_errors() -> tuple[type[BaseException], ...]:
    import grpc
    from google.api_core import exceptions as api_exceptions

    return (api_exceptions.GoogleAPIError, grpc.RpcError)


class SpannerSource(ChangeStreamSource):
    """``ChangeStreamSource`` over one change stream of one database (asyncio client).

    Build it with ``await SpannerSource.connect(config)`` (it owns the client and closes it in
    ``close()``), or around an existing async ``Database`` (then the caller closes that)."""

    def __init__(
        self,
        database: Any,
        change_stream: str,
        *,
        heartbeat_ms: int = 1000,
        max_batch: int = 1024,
        query_window_s: float | None = None,
        trail_s: float | None = None,
        rpc_priority: str | None = None,
        dialect: str = GOOGLE_SQL,
        on_close: Callable[[], Awaitable[None]] | None = None,
        mutable: bool = False,
    ) -> None:
        if dialect not in (GOOGLE_SQL, POSTGRESQL):
            raise ValueError(f"dialect must be {GOOGLE_SQL} or {POSTGRESQL}, got {dialect!r}")
        if not change_stream.replace("_", "").isalnum():
            raise ValueError(f"change stream name must be an identifier: {change_stream!r}")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if query_window_s is not None and not query_window_s > 0:
            raise ValueError(f"query_window_s must be positive, got {query_window_s}")
        if trail_s is not None and not trail_s > 0:
            raise ValueError(f"trail_s must be positive, got {trail_s}")
        self._window_us = None if query_window_s is None else int(query_window_s * 1_000_000)
        self._trail_us = None if trail_s is None else int(trail_s * 1_000_000)
        self._clock: Callable[[], float] = time.time  # commit time is wall-clock time
        self._db = database
        self._stream = change_stream
        self._dialect = dialect
        self._sql = change_stream_sql(dialect, change_stream)
        self._heartbeat_ms = heartbeat_ms
        self._request_options = _request_options(rpc_priority)
        self._max_batch = max_batch
        self._on_close = on_close
        self._layouts: dict[bytes, RecordLayout | PgRecordDecoder | MutableRecordDecoder] = {}
        # a MUTABLE_KEY_RANGE stream: queries end at most 30 minutes after their start
        self.mutable = mutable
        self._errors = _service_errors()
        self._started = 0
        self._active = 0
        self._failed = 0
        self._batches = 0
        self._records = 0
        self._decode_s = 0.0
        self._windows = 0  # windows a partition query moved past (query_window_s)
        self._closed = False
        # a first response slower than this is logged (info): where a query waited
        self.slow_first_s = 3.0 * heartbeat_ms / 1000

    @classmethod
    async def connect(cls, config: SpannerConfig, *, max_batch: int = 1024) -> SpannerSource:
        compat.disable_grpc_fork_support()
        from google.cloud.spanner_v1 import AsyncClient

        client: Any = AsyncClient(**config.client_kwargs())
        database = await client.instance(config.instance).database(
            config.database, database_role=config.database_role
        )

        async def close() -> None:
            await close_async_database(database)
            client.close()  # its HTTP session, if any (the gRPC channel closed above)

        return cls(
            database,
            config.change_stream,
            heartbeat_ms=config.heartbeat_ms,
            max_batch=max_batch,
            query_window_s=config.query_window_s,
            trail_s=config.trail_s,
            rpc_priority=config.rpc_priority,
            on_close=close,
        )

    @property
    def dialect(self) -> str:
        return self._dialect

    async def detect_dialect(self, name: str = "") -> str:
        """Ask the database its dialect (:func:`detect_dialect`; ``name`` for messages) and read
        its change stream the way that dialect does from now on; returns the dialect."""
        dialect, stream = await detect_dialect(self._db, name or "?", self._stream)
        self._dialect, self._stream = dialect, stream
        self._sql = change_stream_sql(dialect, stream)
        if dialect == POSTGRESQL:
            log.info("database %s is PostgreSQL-dialect: reading %s", name or "?", self._sql)
        return dialect

    async def watched_tables(self) -> tuple[str, ...] | None:
        """The tables the change stream watches, from the information schema (two small
        queries), for warning about filters that match none; None where that is not known: a
        PostgreSQL-dialect database (not asked), or the schema cannot be read (logged)."""
        if self._dialect != GOOGLE_SQL:
            return None
        from google.cloud.spanner_v1 import param_types

        params, types = {"stream": self._stream}, {"stream": param_types.STRING}
        try:
            async with self._db.snapshot() as snapshot:
                rs = await snapshot.execute_sql(_WATCHES_ALL_SQL, params=params, param_types=types)
                watches_all = [bool(row[0]) async for row in rs]
            if not watches_all:
                return None  # no such stream: reading it reports that
            async with self._db.snapshot() as snapshot:
                if watches_all[0]:
                    rs = await snapshot.execute_sql(_ALL_TABLES_SQL)
                else:
                    rs = await snapshot.execute_sql(
                        _STREAM_TABLES_SQL, params=params, param_types=types
                    )
                return tuple(sorted({str(row[0]) async for row in rs}))
        except _service_errors() as exc:
            log.info("could not read the tables change stream %s watches: %s", self._stream, exc)
            return None

    async def stream_options(self) -> StreamOptions | None:
        """The change stream's options (``protocol.stream_options``), read once from the
        information schema in the database's dialect (call :meth:`detect_dialect` first);
        None when the database has no such stream (reading it reports that). A failure to read
        them propagates: the caller decides."""
        from google.cloud.spanner_v1 import param_types

        async with self._db.snapshot() as snapshot:
            rs = await snapshot.execute_sql(_STREAMS_SQL)
            streams = [str(row[0]) async for row in rs]
        if self._stream not in streams:
            return None

        if self._dialect == POSTGRESQL:
            sql, params = _PG_OPTIONS_SQL, {"p1": self._stream}
            types = {"p1": param_types.STRING}
        else:
            sql, params = _OPTIONS_SQL, {"stream": self._stream}
            types = {"stream": param_types.STRING}
        async with self._db.snapshot() as snapshot:
            rs = await snapshot.execute_sql(sql, params=params, param_types=types)
            rows = [(str(row[0]), str(row[1])) async for row in rs]
        options = stream_options(rows)
        self.mutable = options.mutable_key_range
        return options

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            await self._on_close()

    async def __aenter__(self) -> SpannerSource:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def statistics(self) -> SourceStats:
        return SourceStats(
            self._started,
            self._active,
            self._failed,
            self._batches,
            self._records,
            self._decode_s,
            self._windows,
        )

    # -- the port -----------------------------------------------------------------------------
    def _params(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        from google.cloud.spanner_v1 import param_types

        if self._dialect == POSTGRESQL:
            return (
                {
                    "p1": micros_to_datetime(start_ts),
                    "p2": None if end_ts is None else micros_to_datetime(end_ts),
                    "p3": token,
                    "p4": self._heartbeat_ms,
                },
                {
                    "p1": param_types.TIMESTAMP,
                    "p2": param_types.TIMESTAMP,
                    "p3": param_types.STRING,
                    "p4": param_types.INT64,
                },
            )
        params: dict[str, Any] = {
            "start": micros_to_datetime(start_ts),
            "end": None if end_ts is None else micros_to_datetime(end_ts),
            "token": token,
            "hb": self._heartbeat_ms,
        }
        types = {
            "start": param_types.TIMESTAMP,
            "end": param_types.TIMESTAMP,
            "token": param_types.STRING,
            "hb": param_types.INT64,
        }
        return params, types

    def _layout(self, column_type: Any) -> RecordLayout | PgRecordDecoder | MutableRecordDecoder:
        """The decoder of a result set whose one column has type ``column_type``: a JSON column
        is the PostgreSQL form, a PROTO one a MUTABLE_KEY_RANGE stream's ``ChangeRecord``,
        anything else the GoogleSQL STRUCTs."""
        key: bytes = column_type.SerializeToString()
        layout = self._layouts.get(key)
        if layout is None:
            from google.cloud.spanner_v1 import TypeCode

            if column_type.code == TypeCode.JSON:
                layout = PgRecordDecoder()
            elif column_type.code == TypeCode.PROTO:
                layout = MutableRecordDecoder()
            else:
                layout = RecordLayout(column_type)
            self._layouts[key] = layout
        return layout

    async def query(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        """Records of partition ``token`` from ``start_ts`` (inclusive) on, in batches of at most
        ``max_batch``, as the server sends them; ends when the partition ends or at ``end_ts``
        (inclusive). With ``query_window_s``, one query per window (see the module's notes)."""
        if self._closed:
            raise RuntimeError("SpannerSource is closed")
        window = self._window_us
        if self.mutable:
            # a MUTABLE_KEY_RANGE query needs an end at most 30 minutes out (protocol/mutable.py)
            window = MAX_QUERY_SPAN_US if window is None else min(window, MAX_QUERY_SPAN_US)
            if token is None:
                end_ts = query_end(start_ts, end_ts)
        if token is not None and self._trail_us is not None:
            async with contextlib.aclosing(self._query_trailing(token, start_ts, end_ts)) as it:
                async for batch in it:
                    yield batch
            return
        if token is None or window is None:
            async with contextlib.aclosing(self._query_once(token, start_ts, end_ts)) as once:
                async for batch in once:
                    yield batch
            return
        start = start_ts
        while True:
            last = end_ts is not None and end_ts - start <= window
            stop = end_ts if last else start + window
            ended = False  # the partition ended inside this window (ChildPartitions seen)
            reached = -1  # the newest timestamp this query itself vouched for
            async with contextlib.aclosing(self._query_once(token, start, stop)) as once:
                async for batch in once:
                    for r in batch:
                        if isinstance(r, Heartbeat):
                            reached = max(reached, r.timestamp)
                        elif isinstance(r, DataChange):
                            reached = max(reached, r.commit_ts)
                        elif isinstance(r, ChildPartitions | PartitionEnd):
                            ended = True
                    yield batch
            if ended or last:
                return
            assert stop is not None
            self._windows += 1
            if reached >= start:
                # go on from just after what the query itself vouched for (its last heartbeat
                # or record), not from its window's end, which it may not have reached: the
                # next query covers that stretch again (Spanner returns nothing more there, so
                # this costs a short re-read). (Not what lost records against the emulator:
                # that was its live queries' scan-step gap, see "Trailing".)
                start = reached + 1
            else:
                # the query vouched for nothing: it returned everything up to its (inclusive)
                # end, and saying so moves the consumer's position on, as Spanner's heartbeats
                # do
                yield [Heartbeat(stop)]
                start = stop + 1

    async def _query_trailing(
        self, token: str, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        """``query`` reading only the past (``trail_s``, see the module's notes): windows of at
        most ``query_window_s`` that end ``trail_s`` before now, a ``Heartbeat`` at each one's
        end, and a pause of ``trail_s`` whenever the reading reached that horizon."""
        assert self._trail_us is not None
        trail = self._trail_us
        window = self._window_us
        if self.mutable:  # (the 30-minute bound of a MUTABLE_KEY_RANGE query)
            window = MAX_QUERY_SPAN_US if window is None else min(window, MAX_QUERY_SPAN_US)
        start = start_ts
        while True:
            horizon = int(self._clock() * 1_000_000) - trail
            stop = horizon if window is None else min(horizon, start + window)
            last = end_ts is not None and end_ts <= stop
            if last:
                assert end_ts is not None
                stop = end_ts
            if stop < start:
                await asyncio.sleep((start - stop) / 1_000_000)
                continue
            ended = False
            async with contextlib.aclosing(self._query_once(token, start, stop)) as once:
                async for batch in once:
                    ended = ended or any(
                        isinstance(r, ChildPartitions | PartitionEnd) for r in batch
                    )
                    yield batch
            if ended or last:
                return
            self._windows += 1
            # the query's end was past when it was sent: it returned everything up to it
            yield [Heartbeat(stop)]
            start = stop + 1
            if stop == horizon:
                await asyncio.sleep(trail / 1_000_000)

    async def _query_once(
        self, token: str | None, start_ts: int, end_ts: int | None
    ) -> AsyncGenerator[list[ChangeRecord], None]:
        """One partition query over ``[start_ts, end_ts]``."""
        params, types = self._params(token, start_ts, end_ts)
        self._started += 1
        self._active += 1
        t0 = time.monotonic()
        t1 = t2 = -1.0
        first = True
        try:
            async with self._db.snapshot() as snapshot:
                t1 = time.monotonic()
                rs = await snapshot.execute_sql(
                    self._sql,
                    params=params,
                    param_types=types,
                    lazy_decode=True,
                    request_options=self._request_options,
                )
                t2 = time.monotonic()
                try:
                    async with contextlib.aclosing(self.decode_result_set(rs)) as batches:
                        async for batch in batches:
                            if first:
                                first = False
                                waited = time.monotonic() - t0
                                if waited > self.slow_first_s:
                                    log.info(
                                        "query of %s from %d: first response after %.1fs "
                                        "(snapshot %.1fs, execute_sql %.1fs)",
                                        token,
                                        start_ts,
                                        waited,
                                        t1 - t0,
                                        t2 - t1,
                                    )
                            yield batch
                finally:
                    await compat.cancel_stream(rs)
        except self._errors as exc:
            self._failed += 1
            code = status_name(exc)
            if code in FATAL_CODES:
                assert code is not None
                lines = str(exc).strip().splitlines()
                detail = lines[0] if lines else type(exc).__name__
                raise ChangeStreamUnreadable(token, start_ts, code, detail) from exc
            raise PartitionQueryError(token, start_ts, f"{type(exc).__name__}: {exc}") from exc
        except DecodeError as exc:
            self._failed += 1
            raise PartitionQueryError(token, start_ts, str(exc), retryable=False) from exc
        finally:
            self._active -= 1
            if first and time.monotonic() - t0 > self.slow_first_s:
                log.info(
                    "query of %s from %d: ended after %.1fs without any response (snapshot "
                    "%s, execute_sql %s)",
                    token,
                    start_ts,
                    time.monotonic() - t0,
                    "pending" if t1 < 0 else f"{t1 - t0:.1f}s",
                    "pending" if t2 < 0 else f"{t2 - t1:.1f}s",
                )

    async def decode_result_set(self, rs: Any) -> AsyncGenerator[list[ChangeRecord], None]:
        """Batches of records from a change-stream ``StreamedResultSet`` opened with
        ``lazy_decode=True``: one partial result set at a time, split at ``max_batch``.

        Consumes the result set's response iterator directly (one column, so every complete
        value is a row) and merges chunked values with the client's own merge function."""
        from google.cloud.spanner_v1.types import PartialResultSet

        merge = compat.merge_function()
        responses = compat.response_iterator(rs)
        layout: RecordLayout | PgRecordDecoder | MutableRecordDecoder | None = None
        column_type: Any = None
        pending: Any = None  # the chunked last value of the previous partial result set
        max_batch = self._max_batch
        async for response in responses:
            pb = PartialResultSet.pb(response)
            if layout is None:
                column_type = RecordLayout.column_type(pb.metadata.row_type.fields)
                layout = self._layout(column_type)
            values: Any = pb.values
            if pending is not None or pb.chunked_value:
                values = list(values)
                if pending is not None:
                    values[0] = merge(pending, values[0], column_type)
                    pending = None
                if pb.chunked_value:
                    pending = values.pop()
            if not values:
                continue
            # (a MUTABLE_KEY_RANGE stream's lifecycle records travel the same way: the port
            # is typed with the other mode's records; the reader core takes both)
            out: list[Any] = []
            t0 = time.perf_counter()
            layout.decode_values(values, out)
            self._decode_s += time.perf_counter() - t0
            self._records += len(out)
            if len(out) <= max_batch:
                self._batches += 1
                yield out
                continue
            for i in range(0, len(out), max_batch):
                self._batches += 1
                yield out[i : i + max_batch]
        if pending is not None:
            raise DecodeError("stream ended inside a chunked value")

    # -- the benchmark's baseline -------------------------------------------------------------
    async def count_default_decoded(self, token: str | None, start_ts: int, end_ts: int) -> int:
        """Read a partition with the client's default decoding and count its records: the
        baseline the benchmark compares ``query`` with."""
        params, types = self._params(token, start_ts, end_ts)
        n = 0
        async with self._db.snapshot() as snapshot:
            rs = await snapshot.execute_sql(self._sql, params=params, param_types=types)
            async for row in rs:
                n += count_default_decoded(row)
        return n


async def close_async_database(database: Any) -> None:
    """Stop the database's session maintenance and close its gRPC channel."""
    await database.close()
    transport = compat.database_transport(database)
    if transport is not None:
        await transport.close()


# -- reading a whole time range ---------------------------------------------------------------
class WalkResult(msgspec.Struct):
    """What ``walk_stream`` read: every data record in arrival order, and per partition token its
    query range (start_ts, parents)."""

    data: list[DataChange]
    partitions: dict[str, tuple[int, tuple[str, ...]]]
    heartbeats: int = 0
    child_records: int = 0


async def walk_stream(
    source: Any,
    start_ts: int,
    end_ts: int,
    *,
    concurrency: int = 64,
    on_batch: Callable[[str, Sequence[ChangeRecord]], None] | None = None,
) -> WalkResult:
    """Read every partition of ``source`` (a ``ChangeStreamSource``) over ``[start_ts, end_ts]``,
    following child partitions: a child starts once, after every parent it names has finished
    (a parent not yet discovered counts as unfinished), from the earliest start any parent gave.
    """
    result = WalkResult(data=[], partitions={})
    finished: set[str] = set()
    started: set[str] = set()
    pending: dict[str, tuple[int, tuple[str, ...]]] = {}  # child -> (start, parents)
    limit = asyncio.Semaphore(concurrency)

    async def read(token: str | None, start: int, tg: asyncio.TaskGroup) -> None:
        async with limit:
            it = source.query(token, start, end_ts)
            try:
                async for batch in it:
                    if on_batch is not None and token is not None:
                        on_batch(token, batch)
                    for rec in batch:
                        if isinstance(rec, DataChange):
                            result.data.append(rec)
                        elif isinstance(rec, ChildPartitions):
                            result.child_records += 1
                            note_children(rec)
                        else:
                            result.heartbeats += 1
            finally:
                await it.aclose()
        if token is not None:
            finished.add(token)
        launch(tg)

    def note_children(rec: ChildPartitions) -> None:
        for child in rec.children:
            if child.token in started:
                continue
            old = pending.get(child.token)
            begin = rec.start_ts if old is None else min(old[0], rec.start_ts)
            pending[child.token] = (begin, child.parent_tokens)

    def launch(tg: asyncio.TaskGroup) -> None:
        for token, (begin, parents) in list(pending.items()):
            if all(p in finished for p in parents):
                del pending[token]
                started.add(token)
                result.partitions[token] = (begin, parents)
                tg.create_task(read(token, begin, tg))

    async with asyncio.TaskGroup() as tg:
        tg.create_task(read(None, start_ts, tg))
    if pending:
        log.info("walk_stream: %d child partitions start after end_ts", len(pending))
    return result
