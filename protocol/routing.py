"""Composite topics and shard-consistent routing (docs/design.md#routing).

The rules carried here, as a pure module (no I/O, no clock, no randomness):

* A **composite topic** is an ordered sequence of storage topics ``T_0 .. T_n``; each has
  ``P(T_i)`` partitions and a scale factor ``K``. ``produce_pointer`` names the storage topic the
  next message goes to; it starts at 0 and only :meth:`CompositeTopic.switch_produce` moves it,
  by one, never past the last storage topic (it does not wrap).
* **Produce(m)** goes to ``T_i`` with ``i = produce_pointer``, partition ``Router(hash(m))``::

      Router(h) = K * h % P + (h // P) % K

  This is *shard consistent*: with base ``B = P / K``, key ``h`` lands in the block of ``K``
  partitions ``[K * (h % B), K * (h % B) + K - 1]``, so every storage topic with the same base
  sends a key to the same slice of the partition space. The formula needs ``K`` to divide ``P``
  (otherwise it can name partition ``P`` or above); :func:`router` refuses any other input.
* **AddStorageTopic(n)** appends a storage topic; the produce pointer does not move. With ``ST``
  the new topic and ``T`` the last one: if ``n`` is a multiple of ``P(T) / K(T)`` then
  ``K(ST) = n / (P(T) / K(T))``, otherwise ``K(ST) = 1`` (the subscriptions may need re-sharding).
  The first storage topic has ``K = 1``.
* **Shard assignment**: shard ``sid`` of ``shard_count`` gets the contiguous, inclusive range
  ``[sid * P / shard_count, (sid + 1) * P / shard_count - 1]``. ``shard_count`` should divide
  ``P``; when it does not, integer division still gives contiguous, disjoint ranges covering every
  partition (uneven load is allowed, never assumed away).
* Partition counts are recommended to be 1, 2, 3, or a multiple of 4 or 6, so a topic shards
  evenly across many shard counts (:func:`recommended_partition_count`); not enforced.
* The **key hash** (:func:`key_hash`) is a stable unsigned 64-bit BLAKE2b digest of the table
  name and the primary-key JSON text (the key identity of :mod:`protocol.records`), never
  Python's salted ``hash()``: producers in other processes must agree on it.

Naming: storage topic 0 of composite topic ``N`` is the Kafka topic ``N`` itself; later ones are
``N.1``, ``N.2``, ... so a composite topic that never scaled is one plain topic of the same name.
"""

from __future__ import annotations

import hashlib

import msgspec


def router(h: int, partitions: int, k: int) -> int:
    """The partition of hash ``h`` in a storage topic of ``partitions`` partitions scaled by
    ``k``: ``K * h % P + (h // P) % K``."""
    if partitions <= 0 or k <= 0:
        raise ValueError(f"router: partitions={partitions} and k={k} must be positive")
    if partitions % k:
        raise ValueError(f"router: k={k} must divide partitions={partitions}")
    if h < 0:
        raise ValueError(f"router: hash {h} must be unsigned")
    return k * h % partitions + (h // partitions) % k


def key_hash(table: str, keys_json: str) -> int:
    """Stable unsigned 64-bit hash of a row's identity (table, primary-key JSON text)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(table.encode())
    digest.update(b"\x00")
    digest.update(keys_json.encode())
    return int.from_bytes(digest.digest(), "big")


def recommended_partition_count(n: int) -> bool:
    """1, 2, 3, or a multiple of 4 or of 6 (the design's advice for even sharding)."""
    return n in (1, 2, 3) or (n > 0 and (n % 4 == 0 or n % 6 == 0))


def partitions_for_shard(sid: int, partitions: int, shard_count: int) -> range:
    """Partitions of shard ``sid``: ``[sid * P / S, (sid + 1) * P / S - 1]``, both inclusive."""
    if shard_count <= 0 or not 0 <= sid < shard_count:
        raise ValueError(f"shard {sid} out of range for shard_count={shard_count}")
    if partitions <= 0:
        raise ValueError(f"partitions={partitions} must be positive")
    return range(sid * partitions // shard_count, (sid + 1) * partitions // shard_count)


def shard_of_partition(partition: int, partitions: int, shard_count: int) -> int:
    """The shard whose range (see :func:`partitions_for_shard`) holds ``partition``."""
    if not 0 <= partition < partitions:
        raise ValueError(f"partition {partition} out of range for {partitions} partitions")
    if shard_count <= 0:
        raise ValueError(f"shard_count={shard_count} must be positive")
    return ((partition + 1) * shard_count - 1) // partitions


class StorageTopic(msgspec.Struct, frozen=True):
    """One storage topic of a composite topic: its Kafka name, partition count and scale K."""

    name: str
    partitions: int
    k: int = 1

    @property
    def base(self) -> int:
        """``P / K``: the partition count of the topic this one is a scaled-up copy of."""
        return self.partitions // self.k

    def route(self, h: int) -> int:
        return router(h, self.partitions, self.k)


class ShardAssignment(msgspec.Struct, frozen=True):
    """The partitions of one storage topic a shard reads (seed: ``ShardAssignment``)."""

    topic_name: str
    storage_topic_idx: int
    assigned_partitions: tuple[int, ...]


def storage_topic_name(composite: str, index: int) -> str:
    """Kafka name of storage topic ``index`` of composite topic ``composite``."""
    return composite if index == 0 else f"{composite}.{index}"


class CompositeTopic(msgspec.Struct, frozen=True):
    """An ordered sequence of storage topics and the produce pointer. Every operation returns a
    new value."""

    name: str
    storage_topics: tuple[StorageTopic, ...]
    produce_pointer: int = 0

    def __post_init__(self) -> None:
        if not self.storage_topics:
            raise ValueError(f"composite topic {self.name!r} needs a storage topic")
        if not 0 <= self.produce_pointer < len(self.storage_topics):
            raise ValueError(f"{self.name}: produce_pointer {self.produce_pointer} out of range")
        for st in self.storage_topics:
            if st.partitions <= 0 or st.k <= 0 or st.partitions % st.k:
                raise ValueError(f"{self.name}: bad storage topic {st}")

    @classmethod
    def create(cls, name: str, partitions: int) -> CompositeTopic:
        """A composite topic with one storage topic (``K = 1``) named ``name``."""
        return cls(name, (StorageTopic(storage_topic_name(name, 0), partitions, 1),))

    def add_storage_topic(self, partitions: int) -> CompositeTopic:
        """AddStorageTopic(n): append a storage topic; the produce pointer does not move."""
        if partitions <= 0:
            raise ValueError(f"{self.name}: partitions={partitions} must be positive")
        base = self.storage_topics[-1].base
        k = partitions // base if partitions % base == 0 else 1
        st = StorageTopic(storage_topic_name(self.name, len(self.storage_topics)), partitions, k)
        return msgspec.structs.replace(self, storage_topics=(*self.storage_topics, st))

    def switch_produce(self) -> CompositeTopic:
        """SwitchProduce(): move the pointer to the next storage topic; stays at the last."""
        last = len(self.storage_topics) - 1
        return msgspec.structs.replace(self, produce_pointer=min(self.produce_pointer + 1, last))

    @property
    def producing(self) -> StorageTopic:
        return self.storage_topics[self.produce_pointer]

    def route(self, h: int) -> tuple[int, int]:
        """Produce(m) target for hash ``h``: (storage topic index, partition)."""
        return self.produce_pointer, self.producing.route(h)

    def shard_assignment(self, sid: int, shard_count: int) -> tuple[ShardAssignment, ...]:
        """Partitions of every storage topic that shard ``sid`` of ``shard_count`` reads."""
        return tuple(
            ShardAssignment(
                self.name, i, tuple(partitions_for_shard(sid, st.partitions, shard_count))
            )
            for i, st in enumerate(self.storage_topics)
        )
