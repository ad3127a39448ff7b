"""A connector's own records beside a file or Spark output, apart from its commits
(``runtime.files.commit``): where it started (``protocol.commit.StartRecord``) and how far the output
is complete (``protocol.completeness.Mark``), both under ``<output>/_shoal/<connector>/``.

The start record lets every broker refuse a different explicit start alike: a persistent
Kafka's sync topic records the start, an embedded broker's is gone after a restart, and the
output's progress files would then let the new start skip a window silently. It also gives a
restart that lost its sync topic the connector's first start, so the partitions are found again
from there and each resumes from its progress file.

A file that cannot be decoded raises ``runtime.files.commit.CorruptState`` naming it (the run stops,
exit 1); nothing here is retried silently.
"""

from __future__ import annotations

import os

import msgspec

from protocol.commit import (
    StartRecord,
    completeness_path,
    decode_start,
    encode_start,
    start_path,
)
from protocol.completeness import Mark
from runtime.files.commit import CorruptState
from runtime.lake.store import Store, open_store

__all__ = ["OutputState"]

_mark_decoder = msgspec.json.Decoder(Mark)


class OutputState:
    """Connector ``connector``'s start record and completeness mark under output ``root`` (a
    directory, a URI or a ``Store``). Blocking I/O: call it from a worker thread on a running
    loop."""

    def __init__(self, root: str | os.PathLike[str] | Store, connector: str) -> None:
        self.store = root if isinstance(root, Store) else open_store(root)
        self.connector = connector
        self._start = start_path(connector)
        self._mark = completeness_path(connector)
        self.start_file = self.store.uri_for(self._start)
        self.mark_file = self.store.uri_for(self._mark)

    def __repr__(self) -> str:
        return f"OutputState({self.store.uri_for()!r}, {self.connector!r})"

    def read_start(self) -> StartRecord | None:
        """The recorded start, or None when the connector never started on this output."""
        data = self.store.read_bytes(self._start)
        if data is None:
            return None
        try:
            return decode_start(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptState(
                f"output state: start record {self.start_file} of connector "
                f"{self.connector!r} cannot be read ({exc}; {len(data)} bytes); write it again "
                'as {"connector": ..., "start_us": <micros>, "start": "<RFC 3339>"} with the '
                "connector's first start, or delete it if the connector never ran on this output"
            ) from exc

    def record_start(self, start_us: int, text: str) -> StartRecord:
        """Record the start once: the record already there (another process's, or an earlier
        run's) wins and is returned. Create-if-absent where the store can (two processes
        starting together agree on the first); elsewhere a plain write after the read."""
        found = self.read_start()
        if found is not None:
            return found
        record = StartRecord(self.connector, start_us, text)
        data = encode_start(record)
        if self.store.supports_create_if_absent:
            if not self.store.create_if_absent(self._start, data):
                found = self.read_start()
                assert found is not None
                return found
        else:
            self.store.write_bytes(self._start, data)
        return record

    def read_mark(self) -> Mark | None:
        data = self.store.read_bytes(self._mark)
        if data is None:
            return None
        try:
            return _mark_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CorruptState(
                f"output state: completeness mark {self.mark_file} cannot be read ({exc}); "
                "delete it (the next run writes it again)"
            ) from exc

    def write_mark(self, mark: Mark) -> None:
        """Replace the mark atomically (readers see the old one or the new one)."""
        self.store.write_bytes(self._mark, msgspec.json.encode(mark) + b"\n", fsync=False)
