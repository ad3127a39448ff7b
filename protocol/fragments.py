"""Sync messages bigger than one Kafka record: cut into fragments, put back together on reading.

A checkpoint, an epoch's plan or a task's state grows with the partitions it lists (about 100
bytes each): at 10,000 partitions one message is over a megabyte, more than Kafka accepts in one
record (``max.request.size`` / ``message.max.bytes``, 1 MB by default). The sync log cuts such a
payload into fragments and a reader puts them back together; the cores never see fragments.

Rules:

* A fragment is ``PREFIX`` + msgpack of :class:`Fragment`. ``PREFIX`` (0xC1) never begins a JSON
  sync message (it is not valid UTF-8), so a reader tells fragments apart by one byte.
* One writer appends the fragments of a message in order, each after the one before it was
  acknowledged; fragments ``1..n-1`` carry ``first``, the offset of fragment 0. Other writers'
  messages may fall between them.
* The message is read at the offset of its **last** fragment (it exists once complete), and
  :func:`cut`'s caller reports the offset of fragment 0 as where the message begins (where a
  reader must start to see it whole: the checkpoint pointer).
* A reader that starts in the middle of a message (its fragment 0 is before the start) is told
  to **rewind** to ``first``, collect only that message's fragments up to where it was, and go
  on; everything else it reads again there was already handled and is skipped.
* Bounded: a message whose writer died between fragments never completes; it is dropped (and
  counted) once its fragment 0 is ``max_gap`` offsets behind, or when pending fragments exceed
  ``max_pending_bytes``. A fragment seen twice (a retried append) is ignored.

:class:`Reassembler` is pure: offsets and payloads in, results out; the Kafka adapter seeks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from random import Random

import msgspec

PREFIX = b"\xc1"

__all__ = [
    "PREFIX",
    "Complete",
    "Fragment",
    "FragmentError",
    "Reassembler",
    "Rewind",
    "cut",
    "decode_fragment",
    "encode_fragment",
    "is_fragment",
    "new_id",
]


class Fragment(msgspec.Struct, frozen=True, array_like=True):
    id: str
    index: int
    count: int
    first: int  # offset of fragment 0; -1 in fragment 0 itself
    data: bytes


class FragmentError(ValueError):
    """A payload that starts like a fragment but is not one."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Fragment)


def new_id(rng: Random) -> str:
    """A fragment id: 128 bits from ``rng`` (injected, like every core's randomness; the Kafka
    adapter passes a generator seeded from the operating system, so ids of different
    processes do not collide)."""
    return f"{rng.getrandbits(128):032x}"


def is_fragment(payload: bytes) -> bool:
    return payload[:1] == PREFIX


def encode_fragment(fragment: Fragment) -> bytes:
    return PREFIX + _encoder.encode(fragment)


def decode_fragment(payload: bytes) -> Fragment:
    try:
        fragment = _decoder.decode(payload[1:])
    except msgspec.DecodeError as exc:
        raise FragmentError(f"unreadable fragment: {exc}") from exc
    if not 0 <= fragment.index < fragment.count:
        raise FragmentError(f"fragment {fragment.index} of {fragment.count}")
    if (fragment.index == 0) != (fragment.first == -1):
        raise FragmentError(f"fragment {fragment.index} with first={fragment.first}")
    return fragment


def cut(payload: bytes, max_bytes: int) -> list[bytes]:
    """``payload`` in pieces of at most ``max_bytes`` (at least two pieces: only cut what does
    not fit in one record)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    return [payload[i : i + max_bytes] for i in range(0, len(payload), max_bytes)]


@dataclass(frozen=True)
class Complete:
    """A whole message: read it at ``offset`` (its last fragment's, or its own)."""

    offset: int
    payload: bytes


@dataclass(frozen=True)
class Rewind:
    """Seek to ``offset`` and feed from there; the reassembler knows where to resume."""

    offset: int


@dataclass
class _Pending:
    first: int
    count: int
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


class Reassembler:
    """Feed every record of the log in order from ``start`` (and after a :class:`Rewind`, from
    its offset); :meth:`feed` returns what to do with it."""

    def __init__(
        self, start: int, *, max_gap: int = 100_000, max_pending_bytes: int = 256 << 20
    ) -> None:
        self.start = start
        self.max_gap = max_gap
        self.max_pending_bytes = max_pending_bytes
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._pending_bytes = 0
        self._recovering: set[str] = set()
        self._resume_at = -1  # while rewound: records before this were handled already
        self._rewound: set[str] = set()
        self.dropped: list[str] = []  # why messages were dropped (the adapter logs and counts)

    def feed(self, offset: int, payload: bytes) -> Complete | Rewind | None:
        rewound = offset < self._resume_at
        if not rewound:
            if self._resume_at >= 0:
                self._resume_at = -1
                self._recovering.clear()
            self._evict(offset)
        if not is_fragment(payload):
            return None if rewound else Complete(offset, payload)
        try:
            fragment = decode_fragment(payload)
        except FragmentError as exc:
            if not rewound:
                self.dropped.append(f"offset {offset}: {exc}")
            return None
        if rewound:
            if fragment.id in self._recovering:
                self._add(offset, fragment)
            return None
        pending = self._pending.get(fragment.id)
        if pending is None and fragment.index > 0:
            if fragment.first < self.start and fragment.id not in self._rewound:
                # Started reading in the middle of this message: fetch its beginning.
                self._rewound.add(fragment.id)
                self._recovering = {fragment.id}
                self._resume_at = offset
                return Rewind(fragment.first)
            self.dropped.append(
                f"offset {offset}: fragment {fragment.index}/{fragment.count} of {fragment.id} "
                "without its beginning"
            )
            return None
        return self._add(offset, fragment)

    def _add(self, offset: int, fragment: Fragment) -> Complete | None:
        pending = self._pending.get(fragment.id)
        if pending is None:
            first = offset if fragment.index == 0 else fragment.first
            pending = self._pending[fragment.id] = _Pending(first, fragment.count)
        if fragment.index in pending.parts or fragment.count != pending.count:
            return None  # a retried append wrote it twice
        pending.parts[fragment.index] = fragment.data
        pending.size += len(fragment.data)
        self._pending_bytes += len(fragment.data)
        if len(pending.parts) < pending.count:
            return None
        del self._pending[fragment.id]
        self._pending_bytes -= pending.size
        return Complete(offset, b"".join(pending.parts[i] for i in range(pending.count)))

    def _evict(self, offset: int) -> None:
        while self._pending:
            fid, oldest = next(iter(self._pending.items()))
            too_old = offset - oldest.first > self.max_gap
            if not too_old and self._pending_bytes <= self.max_pending_bytes:
                return
            del self._pending[fid]
            self._pending_bytes -= oldest.size
            self.dropped.append(
                f"message {fid} from offset {oldest.first} never completed "
                f"({len(oldest.parts)}/{oldest.count} fragments)"
            )

    @property
    def pending(self) -> int:
        return len(self._pending)
