"""Read one snapshot partition in its own process, from its serialised form only.

Usage: ``python -m tests.proc_snapshot_read CHUNK_ROWS`` with a JSON object on stdin:
``{"config": <SpannerConfig>, "item": <SnapshotPartition>}``. Prints the partition's chunks as
one JSON array (``SnapshotChunk``) on stdout.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
from google.cloud import spanner

from runtime import compat
from runtime.spanner.config import SpannerConfig
from runtime.spanner.emulator import close_sync_client
from runtime.spanner.snapshot import SnapshotPartition, read_partition


class _Job(msgspec.Struct, frozen=True):
    config: SpannerConfig
    item: SnapshotPartition


def main() -> None:
    chunk_rows = int(sys.argv[1])
    job = msgspec.json.decode(sys.stdin.buffer.read(), type=_Job)
    compat.disable_grpc_fork_support()
    client: Any = spanner.Client(**job.config.client_kwargs())
    database = client.instance(job.config.instance).database(job.config.database)
    try:
        chunks = list(read_partition(database, job.item, chunk_rows))
    finally:
        close_sync_client(client, [database])
    sys.stdout.buffer.write(msgspec.json.encode(chunks))


if __name__ == "__main__":
    main()
