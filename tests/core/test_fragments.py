"""Sync messages bigger than one record (protocol/fragments.py): cut, interleaved with other
writers' messages, put back together from any start offset, each message exactly once."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.fragments import (
    Complete,
    Fragment,
    FragmentError,
    Reassembler,
    Rewind,
    cut,
    decode_fragment,
    encode_fragment,
    is_fragment,
)


class Writer:
    """One message being appended, one record per step (so others can fall between)."""

    def __init__(self, log: list[bytes], fid: str, payload: bytes, max_bytes: int) -> None:
        self.log, self.fid, self.payload = log, fid, payload
        self.pieces = cut(payload, max_bytes) if len(payload) > max_bytes else [payload]
        self.next, self.first, self.last = 0, -1, -1

    @property
    def done(self) -> bool:
        return self.next == len(self.pieces)

    def step(self) -> None:
        if len(self.pieces) == 1:
            record = self.payload
        else:
            fragment = Fragment(
                self.fid, self.next, len(self.pieces), self.first, self.pieces[self.next]
            )
            record = encode_fragment(fragment)
        self.log.append(record)
        if self.next == 0:
            self.first = len(self.log) - 1
        self.last = len(self.log) - 1
        self.next += 1


def read(log: list[bytes], start: int, **kwargs: int) -> tuple[list[Complete], Reassembler]:
    """Read like KafkaSyncLog.read: feed from ``start``, seek on a rewind."""
    whole = Reassembler(start, **kwargs)
    out: list[Complete] = []
    pos = start
    while pos < len(log):
        step = whole.feed(pos, log[pos])
        if isinstance(step, Rewind):
            assert step.offset < pos
            pos = step.offset
            continue
        if step is not None:
            out.append(step)
        pos += 1
    return out, whole


def test_round_trip_and_bad_fragments() -> None:
    fragment = Fragment("a", 1, 3, 7, b"xyz")
    raw = encode_fragment(fragment)
    assert is_fragment(raw)
    assert not is_fragment(b'{"t":"state"}')
    assert decode_fragment(raw) == fragment
    with pytest.raises(FragmentError, match="unreadable"):
        decode_fragment(raw[:-2])
    with pytest.raises(FragmentError, match="fragment 3 of 3"):
        decode_fragment(encode_fragment(Fragment("a", 3, 3, 7, b"")))
    with pytest.raises(FragmentError, match="first=-1"):
        decode_fragment(encode_fragment(Fragment("a", 1, 3, -1, b"")))
    assert cut(b"abcdefg", 3) == [b"abc", b"def", b"g"]


def test_interleaved_message_is_read_at_its_last_fragment() -> None:
    log: list[bytes] = []
    big = Writer(log, "big", b"0123456789", 4)  # three fragments
    big.step()
    log.append(b"small-1")
    big.step()
    log.append(b"small-2")
    big.step()
    got, whole = read(log, 0)
    assert [(c.offset, c.payload) for c in got] == [
        (1, b"small-1"),
        (3, b"small-2"),
        (4, b"0123456789"),
    ]
    assert whole.pending == 0
    assert whole.dropped == []


def test_starting_inside_a_message_rewinds_for_its_beginning_once() -> None:
    log: list[bytes] = []
    big = Writer(log, "big", b"0123456789", 4)
    log.append(b"before")
    big.step()  # 1
    log.append(b"small-1")  # 2
    big.step()  # 3
    log.append(b"small-2")  # 4
    big.step()  # 5
    log.append(b"after")  # 6
    whole = Reassembler(3)
    assert whole.feed(3, log[3]) == Rewind(1)
    assert whole.feed(1, log[1]) is None  # collected, not a result
    assert whole.feed(2, log[2]) is None  # handled before the start: not read again
    assert whole.feed(3, log[3]) is None
    assert whole.feed(4, log[4]) == Complete(4, b"small-2")
    assert whole.feed(5, log[5]) == Complete(5, b"0123456789")
    got, _ = read(log, 4)
    assert [c.payload for c in got] == [b"small-2", b"0123456789", b"after"]


def test_duplicates_orphans_and_abandoned_messages() -> None:
    log: list[bytes] = []
    w = Writer(log, "dup", b"abcdef", 2)
    w.step()
    log.append(log[-1])  # a retried append wrote fragment 0 twice
    w.step()
    w.step()
    dead = Writer(log, "dead", b"abcdef", 2)
    dead.step()  # the writer died here: never completes
    log.append(encode_fragment(Fragment("ghost", 2, 3, 0, b"zz")))  # its beginning is ours
    log.extend(f"m{n}".encode() for n in range(5))
    got, whole = read(log, 0, max_gap=4)
    assert [c.payload for c in got] == [b"abcdef", b"m0", b"m1", b"m2", b"m3", b"m4"]
    assert whole.pending == 0
    assert len(whole.dropped) == 2
    assert "ghost without its beginning" in whole.dropped[0]
    assert "message dead from offset 4 never completed (1/3 fragments)" in whole.dropped[1]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    writers=st.integers(1, 4),
    seed=st.integers(0, 2**32),
    max_bytes=st.integers(3, 12),
)
def test_any_interleaving_any_start_each_message_once(
    sizes: list[int], writers: int, seed: int, max_bytes: int
) -> None:
    rng = random.Random(seed)
    log: list[bytes] = []
    queues: list[list[bytes]] = [[] for _ in range(writers)]
    for n, size in enumerate(sizes):
        queues[n % writers].append(bytes([65 + n % 26]) * size + f"#{n}".encode())
    active: dict[int, Writer] = {}
    last: dict[bytes, int] = {}
    while any(queues) or active:
        w = rng.choice([i for i in range(writers) if queues[i] or i in active])
        if w not in active:
            payload = queues[w].pop(0)
            active[w] = Writer(log, f"w{w}-{len(log)}", payload, max_bytes)
        writer = active[w]
        writer.step()
        if writer.done:
            last[writer.payload] = writer.last
            del active[w]
    for start in range(len(log)):
        got, whole = read(log, start)
        want = sorted((at, p) for p, at in last.items() if at >= start)
        assert [(c.offset, c.payload) for c in got] == want
        assert whole.dropped == []
        assert whole.pending == 0
