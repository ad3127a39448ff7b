"""What a failure on the way to Kafka means for whoever retries it: a refusal (a certificate, a
plaintext listener for TLS, a SASL mechanism or login) that retrying cannot mend, a setting found
wrong (a bad option), or a connection problem worth retrying. Each looks through the chain of
causes, since clients wrap what went wrong."""

from __future__ import annotations

from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
)

from runtime.kafka.config import KafkaRefused, KafkaSettingError
from runtime.kafka.synclog import SyncTopicUnusable

__all__ = ["bad_setting_in", "cause_in", "is_transient", "refusal_in"]

_TRANSIENT = (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
    ConnectionError,
    TimeoutError,
)


def cause_in(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc``'s chain of causes, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kinds):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def refusal_in(exc: BaseException) -> BaseException | None:
    """The :class:`KafkaRefused` behind ``exc`` (an untrusted certificate, a plaintext listener
    for TLS, a SASL mechanism or login refused), if any: retrying cannot help."""
    return cause_in(exc, (KafkaRefused,))


def bad_setting_in(exc: BaseException) -> BaseException | None:
    """A setting found wrong on the way to Kafka (a TLS file, a sync topic of several
    partitions) behind ``exc``, if any: a bad option (exit 2), not a failure to retry."""
    return cause_in(exc, (KafkaSettingError, SyncTopicUnusable))


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a connection problem worth retrying."""
    return cause_in(exc, _TRANSIENT) is not None
