"""Benchmark: change records per second one process decodes from the Spanner emulator, with
shoal's reader (``lazy_decode`` + ``runtime.spanner.decode``) and with the client's default
decoding, over the same partitions and time range in the same run.

Steps: start the emulator (``runtime.spanner.emulator``), pre-load rows with the load generator's
``bulk`` mode (each commit touches every table with INSERT/UPDATE/DELETE: up to 3 records per
table), discover the partitions of that time range with ``walk_stream`` (following children; this
also warms up), then:

1. **Decoding capacity per process** (the headline ``records_per_s`` /
   ``default_client_records_per_s``): the emulator's responses for those partitions are captured
   once as serialized ``PartialResultSet`` bytes and replayed (one warm-up run, then the best of
   ``--rounds``) through the client's own ``StreamedResultSet``: parse the bytes, merge chunks,
   then either shoal's decoder (``SpannerSource.decode_result_set``) or the client's default row
   decoding followed by building the same ``protocol.records`` from those rows
   (``records_from_default_row``; checked equal in the tests). The default decoding alone, rows
   of Python values with no records built, is reported too (``..._rows_only``). This is what one
   process can decode when the server is not the limit (real Spanner serves many partitions far
   faster than the emulator).
2. **End to end from the emulator**: every partition read concurrently over gRPC, once with each
   decoder. The emulator serves only ~5–10k change records/s here, so both are bounded by it.

3. With ``--postgresql``: the same load (same seed) written to a PostgreSQL-dialect database on
   the same emulator (same tables and stream), captured and replayed through shoal's
   PostgreSQL decoder (``postgresql_records_per_s``, and ``postgresql_ratio`` to the GoogleSQL
   figure of step 1).

Prints figures, and as the last line one JSON object.

4. With ``--partition-mode mutable``: the records of step 1 re-encoded as the
   ``MUTABLE_KEY_RANGE`` form (one row per record: a PROTO column holding the serialized
   ``google.spanner.v1.ChangeStreamRecord``, base64, as the documented types say; the emulator
   cannot create such a stream), then decoded by shoal's decoder
   (``runtime/spanner/mutable_decode.py``; checked equal to the records they came from) and by the
   client's default decoding of a PROTO column (``_parse_value_pb`` with the message type as
   ``column_info``) followed by ``json_format.MessageToDict`` to get the values out
   (``mutable_ratio``); the client's parse alone, which stops at protobuf messages, is reported
   too.

``python -m bench spanner [--quick] [--postgresql] [--partition-mode mutable]``; ``--quick``
stays under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from runtime import compat
from runtime.spanner.decode import count_default_decoded, records_from_default_row
from runtime.spanner.emulator import EmulatorUnavailable, SpannerEmulator
from runtime.spanner.loadgen import LoadGenerator
from runtime.spanner.reader import SpannerSource, walk_stream

Parts = list[tuple[str, int, int]]  # (token, start_ts, end_ts)
EPOCH_RECORDS = 30_000  # per time range: the emulator holds a query's whole result in 128 MB


async def _capture(source: SpannerSource, parts: Parts) -> list[list[bytes]]:
    """The serialized partial result sets the server sends for each partition."""
    from google.cloud.spanner_v1.types import PartialResultSet

    captured: list[list[bytes]] = []
    for token, start, end_ts in parts:
        params, types = source._params(token, start, end_ts)
        responses: list[bytes] = []
        async with source._db.snapshot() as snapshot:
            rs = await snapshot.execute_sql(
                source._sql, params=params, param_types=types, lazy_decode=True
            )
            responses.extend(
                [PartialResultSet.serialize(i) async for i in compat.response_iterator(rs)]
            )
        captured.append(responses)
    return captured


async def _replay(payloads: list[bytes]) -> AsyncIterator[object]:
    from google.cloud.spanner_v1.types import PartialResultSet

    for payload in payloads:
        yield PartialResultSet.deserialize(payload)


async def _replay_fast(source: SpannerSource, captured: list[list[bytes]]) -> int:
    from google.cloud.spanner_v1._async.streamed import StreamedResultSet

    n = 0
    for payloads in captured:
        rs = StreamedResultSet(_replay(payloads), lazy_decode=True)
        async for batch in source.decode_result_set(rs):
            n += len(batch)
    return n


async def _replay_default(captured: list[list[bytes]]) -> int:
    """The client's default decoding, then the same ``protocol.records`` built from its rows."""
    from google.cloud.spanner_v1._async.streamed import StreamedResultSet

    n = 0
    for payloads in captured:
        rs = StreamedResultSet(_replay(payloads))
        async for row in rs:
            n += len(records_from_default_row(row))
    return n


async def _replay_default_rows_only(captured: list[list[bytes]]) -> int:
    """The client's default decoding alone (rows of Python values, no records built)."""
    from google.cloud.spanner_v1._async.streamed import StreamedResultSet

    n = 0
    for payloads in captured:
        rs = StreamedResultSet(_replay(payloads))
        async for row in rs:
            n += count_default_decoded(row)
    return n


async def _read_fast(source: SpannerSource, parts: Parts) -> int:
    counts: list[int] = []

    async def one(token: str, start: int, end_ts: int) -> None:
        n = 0
        async for batch in source.query(token, start, end_ts):
            n += len(batch)
        counts.append(n)

    async with asyncio.TaskGroup() as tg:
        for part in parts:
            tg.create_task(one(*part))
    return sum(counts)


async def _read_default(source: SpannerSource, parts: Parts) -> int:
    counts: list[int] = []

    async def one(token: str, start: int, end_ts: int) -> None:
        counts.append(await source.count_default_decoded(token, start, end_ts))

    async with asyncio.TaskGroup() as tg:
        for part in parts:
            tg.create_task(one(*part))
    return sum(counts)


async def _best(
    rounds: int, run: Callable[[], Awaitable[int]], label: str, *, warmup: bool = False
) -> tuple[float, int]:
    """Best records/s over ``rounds`` runs (after one untimed run if ``warmup``)."""
    n = await run() if warmup else 0
    best = 0.0
    for r in range(rounds):
        t0 = time.perf_counter()
        n = await run()
        dt = time.perf_counter() - t0
        rate = n / dt if dt > 0 else 0.0
        print(f"  {label} round {r + 1}: {n} records in {dt:.2f} s = {rate:,.0f}/s", flush=True)
        best = max(best, rate)
    return best, n


async def _load_and_walk(
    args: argparse.Namespace, loader: LoadGenerator, source: SpannerSource, tables: int
) -> Parts:
    """Pre-load ``args.records`` records, one time range (epoch) at a time, and walk each range
    (which warms up): the partition ranges of the load."""
    per_commit = 3 * tables
    parts: Parts = []
    data_records = 0
    load_s = walk_s = 0.0
    remaining = max(1, args.records // per_commit)
    while remaining > 0:
        commits = min(remaining, max(1, EPOCH_RECORDS // per_commit))
        remaining -= commits
        first = len(loader.committed)
        t0 = time.perf_counter()
        await loader.bulk(commits)
        load_s += time.perf_counter() - t0
        start_ts = loader.committed[first].commit_ts
        end_ts = loader.committed[-1].commit_ts
        t0 = time.perf_counter()
        walk = await walk_stream(source, start_ts, end_ts)
        walk_s += time.perf_counter() - t0
        data_records += len(walk.data)
        parts.extend((tok, begin, end_ts) for tok, (begin, _) in walk.partitions.items())
    print(
        f"pre-loaded {data_records} data records in {load_s:.1f} s "
        f"({tables} tables, {len(parts)} partition ranges); walk (warm-up) {walk_s:.1f} s",
        flush=True,
    )
    return parts


async def _postgresql(args: argparse.Namespace, emulator: SpannerEmulator) -> tuple[float, int]:
    """Step 3: the same load on a PostgreSQL-dialect database, decoded by shoal's reader."""
    config = await asyncio.to_thread(emulator.create_postgresql_database, "shoal-pg")
    loader = await LoadGenerator.connect(config, emulator.tables, seed=1)
    source = await SpannerSource.connect(config, max_batch=4096)
    try:
        await source.detect_dialect(config.database)
        parts = await _load_and_walk(args, loader, source, len(emulator.tables))
        captured = await _capture(source, parts)
        print("PostgreSQL dialect, decoding capacity (captured responses replayed):")
        return await _best(
            args.rounds, lambda: _replay_fast(source, captured), "shoal pg", warmup=True
        )
    finally:
        await source.close()
        await loader.close()


def _value_pb(value: object) -> Any:
    """A JSON value as the ``google.protobuf.Value`` a ChangeStreamRecord carries."""
    from google.protobuf.struct_pb2 import ListValue, Struct, Value

    if value is None:
        return Value(null_value=0)
    if isinstance(value, bool):
        return Value(bool_value=value)
    if isinstance(value, int | float):
        return Value(number_value=value)
    if isinstance(value, str):
        return Value(string_value=value)
    if isinstance(value, list):
        return Value(list_value=ListValue(values=[_value_pb(v) for v in value]))
    if isinstance(value, dict):
        return Value(struct_value=Struct(fields={k: _value_pb(v) for k, v in value.items()}))
    raise TypeError(f"not a JSON value: {value!r}")


def _type_pb(spec: dict[str, Any]) -> Any:
    from google.cloud.spanner_v1.types import Type, TypeCode

    out = Type(code=getattr(TypeCode, spec["code"]))
    if "array_element_type" in spec:
        out.array_element_type = _type_pb(spec["array_element_type"])
    return out


def mutable_rows(records: list[Any]) -> list[Any]:
    """``records`` (data changes and heartbeats) as MUTABLE_KEY_RANGE rows: each a raw
    ``Value`` whose ``string_value`` is the base64 of a serialized ``ChangeStreamRecord``."""
    import base64

    from google.cloud.spanner_v1.types import ChangeStreamRecord
    from google.protobuf.struct_pb2 import Value
    from google.protobuf.timestamp_pb2 import Timestamp

    from protocol.records import DataChange, Heartbeat

    dcr = ChangeStreamRecord.DataChangeRecord
    mod_types = {"INSERT": 10, "UPDATE": 20, "DELETE": 30}
    captures = {"OLD_AND_NEW_VALUES": 10, "NEW_VALUES": 20, "NEW_ROW": 30}
    captures["NEW_ROW_AND_OLD_VALUES"] = 40

    def ts(micros: int) -> Timestamp:
        return Timestamp(seconds=micros // 1_000_000, nanos=micros % 1_000_000 * 1000)

    rows = []
    for r in records:
        if isinstance(r, Heartbeat):
            msg = ChangeStreamRecord(
                heartbeat_record=ChangeStreamRecord.HeartbeatRecord(timestamp=ts(r.timestamp))
            )
        elif isinstance(r, DataChange):
            index = {c.name: i for i, c in enumerate(r.column_types)}

            def values(text: str, index: dict[str, int] = index) -> list[Any]:
                return [
                    dcr.ModValue(column_metadata_index=index[k], value=_value_pb(v))
                    for k, v in json.loads(text).items()
                ]

            msg = ChangeStreamRecord(
                data_change_record=dcr(
                    commit_timestamp=ts(r.commit_ts),
                    record_sequence=r.record_sequence,
                    server_transaction_id=r.server_transaction_id,
                    is_last_record_in_transaction_in_partition=(
                        r.is_last_record_in_transaction_in_partition
                    ),
                    table=r.table,
                    column_metadata=[
                        dcr.ColumnMetadata(
                            name=c.name,
                            type_=_type_pb(json.loads(c.type)),
                            is_primary_key=c.is_primary_key,
                            ordinal_position=c.ordinal_position,
                        )
                        for c in r.column_types
                    ],
                    mods=[
                        dcr.Mod(
                            keys=values(m.keys),
                            new_values=values(m.new_values),
                            old_values=values(m.old_values),
                        )
                        for m in r.mods
                    ],
                    mod_type=mod_types[r.mod_type],
                    value_capture_type=captures.get(r.value_capture_type, 0),
                    number_of_records_in_transaction=r.number_of_records_in_transaction,
                    number_of_partitions_in_transaction=r.number_of_partitions_in_transaction,
                    transaction_tag=r.transaction_tag,
                    is_system_transaction=r.is_system_transaction,
                )
            )
        else:
            continue
        data = ChangeStreamRecord.serialize(msg)
        rows.append(Value(string_value=base64.b64encode(data).decode()))
    return rows


def _mutable(args: argparse.Namespace, records: list[Any]) -> dict[str, object]:
    """Step 4: the same records as MUTABLE_KEY_RANGE rows, decoded both ways."""
    from google.cloud.spanner_v1 import _helpers
    from google.cloud.spanner_v1.types import Type, TypeCode
    from google.protobuf import json_format

    from runtime.spanner.mutable_decode import MutableRecordDecoder, change_record_pb

    rows = mutable_rows(records)
    kept = [r for r in records if type(r).__name__ in ("DataChange", "Heartbeat")]
    check: list[Any] = []
    MutableRecordDecoder().decode_values(rows, check)
    if check != kept:
        wrong = next(i for i, (a, b) in enumerate(zip(check, kept, strict=False)) if a != b)
        raise SystemExit(f"mutable decoding differs at record {wrong}: {check[wrong]!r}")
    column = Type(code=TypeCode.PROTO, proto_type_fqn="google.spanner.v1.ChangeStreamRecord")
    info = {"ChangeRecord": change_record_pb()}
    parse: Any = _helpers._parse_value_pb

    def fast() -> int:
        out: list[Any] = []
        return MutableRecordDecoder().decode_values(rows, out)

    def default() -> int:
        n = 0
        for row in rows:
            n += bool(json_format.MessageToDict(parse(row, column, "ChangeRecord", info)))
        return n

    def parse_only() -> int:
        return len([parse(row, column, "ChangeRecord", info) for row in rows])

    def best(run: Callable[[], int], label: str) -> float:
        run()
        rate = 0.0
        for r in range(args.rounds):
            t0 = time.perf_counter()
            n = run()
            dt = time.perf_counter() - t0
            print(f"  {label} round {r + 1}: {n} records in {dt:.2f} s = {n / dt:,.0f}/s")
            rate = max(rate, n / dt)
        return rate

    print(f"MUTABLE_KEY_RANGE rows: {len(rows)} ChangeStreamRecord rows of the same records")
    shoal = best(fast, "shoal mutable")
    client = best(default, "default+MessageToDict")
    client_parse = best(parse_only, "default parse only")
    print(f"shoal, MUTABLE_KEY_RANGE rows:            {shoal:,.0f} records/s")
    print(
        f"client default + MessageToDict:           {client:,.0f} records/s  "
        f"({shoal / client:.1f}x)"
    )
    print(
        f"client default parse only (messages):     {client_parse:,.0f} records/s  "
        f"({shoal / client_parse:.2f}x)"
    )
    return {
        "mutable_records": len(rows),
        "mutable_records_per_s": round(shoal),
        "mutable_default_client_records_per_s": round(client),
        "mutable_ratio": round(shoal / client, 2) if client else None,
        "mutable_default_parse_only_records_per_s": round(client_parse),
    }


async def _records(source: SpannerSource, captured: list[list[bytes]]) -> list[Any]:
    """The records of the captured responses, decoded by shoal's reader."""
    from google.cloud.spanner_v1._async.streamed import StreamedResultSet

    out: list[Any] = []
    for payloads in captured:
        rs = StreamedResultSet(_replay(payloads), lazy_decode=True)
        async for batch in source.decode_result_set(rs):
            out.extend(batch)
    return out


async def _run(args: argparse.Namespace, emulator: SpannerEmulator) -> dict[str, object]:
    config = emulator.config
    loader = await LoadGenerator.connect(config, emulator.tables, seed=1)
    source = await SpannerSource.connect(config, max_batch=4096)
    try:
        parts = await _load_and_walk(args, loader, source, len(emulator.tables))
        captured = await _capture(source, parts)
        size = sum(len(p) for c in captured for p in c)
        print(f"captured {sum(map(len, captured))} partial result sets, {size / 1e6:.1f} MB")
        print("decoding capacity (captured emulator responses replayed through the client):")
        fast, n_fast = await _best(
            args.rounds, lambda: _replay_fast(source, captured), "shoal", warmup=True
        )
        slow, n_slow = await _best(
            args.rounds, lambda: _replay_default(captured), "default+records", warmup=True
        )
        rows_only, n_rows = await _best(
            args.rounds, lambda: _replay_default_rows_only(captured), "default rows only"
        )
        print("end to end from the emulator (bounded by the emulator):")
        e2e_fast, e2e_n_fast = await _best(1, lambda: _read_fast(source, parts), "shoal")
        e2e_slow, e2e_n_slow = await _best(
            1, lambda: _read_default(source, parts), "default rows only"
        )
        counts = {n_fast, n_slow, n_rows, e2e_n_fast, e2e_n_slow}
        if len(counts) != 1:
            print(f"WARNING: record counts differ between runs: {sorted(counts)}", flush=True)
        print(f"shoal reader (lazy + own decoder):        {fast:,.0f} records/s")
        print(
            f"client default decoding -> same records:  {slow:,.0f} records/s  ({fast / slow:.1f}x)"
        )
        print(
            f"client default decoding, rows only:       {rows_only:,.0f} records/s  "
            f"({fast / rows_only:.1f}x)"
        )
        print(
            f"end to end, shoal / default rows only:    {e2e_fast:,.0f} / {e2e_slow:,.0f} records/s"
        )
        result: dict[str, object] = {
            "scenario": "spanner",
            "records_per_s": round(fast),
            "default_client_records_per_s": round(slow),
            "ratio": round(fast / slow, 2) if slow else None,
            "default_client_rows_only_records_per_s": round(rows_only),
            "ratio_rows_only": round(fast / rows_only, 2) if rows_only else None,
            "records": n_fast,
            "partitions": len(parts),
            "end_to_end_records_per_s": round(e2e_fast),
            "end_to_end_default_rows_only_records_per_s": round(e2e_slow),
        }
        if args.partition_mode == "mutable":
            result.update(_mutable(args, await _records(source, captured)))
    finally:
        await source.close()
        await loader.close()
    if args.postgresql:
        pg, n_pg = await _postgresql(args, emulator)
        if n_pg != n_fast:
            print(f"WARNING: PostgreSQL records {n_pg} != GoogleSQL records {n_fast}", flush=True)
        print(
            f"shoal reader, PostgreSQL dialect:         {pg:,.0f} records/s  "
            f"({pg / fast:.2f}x GoogleSQL)"
        )
        result["postgresql_records_per_s"] = round(pg)
        result["postgresql_records"] = n_pg
        result["postgresql_ratio"] = round(pg / fast, 2) if fast else None
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench spanner", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records; under a minute")
    parser.add_argument("--records", type=int, default=None, help="records to pre-load")
    parser.add_argument("--tables", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--emulator", default=None, help="path of emulator_main")
    parser.add_argument(
        "--postgresql",
        action="store_true",
        help="also decode the same load from a PostgreSQL-dialect database",
    )
    parser.add_argument(
        "--partition-mode",
        choices=("immutable", "mutable"),
        default="immutable",
        help="mutable: also decode the same records as MUTABLE_KEY_RANGE ChangeRecord rows",
    )
    args = parser.parse_args(argv)
    if args.records is None:
        args.records = 40_000 if args.quick else 120_000
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    tables = [f"T{i:02d}" for i in range(args.tables)]
    try:
        emulator = SpannerEmulator(binary=args.emulator, tables=tables)
    except EmulatorUnavailable as exc:
        print(f"spanner benchmark skipped: {exc}", file=sys.stderr)
        print(json.dumps({"scenario": "spanner", "skipped": str(exc)}))
        return 2
    with emulator:
        result = asyncio.run(_run(args, emulator))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
