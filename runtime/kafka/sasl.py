"""Why a SASL login to Kafka failed, in words an operator can act on.

aiokafka logs a refused SASL handshake or login (``UnsupportedSaslMechanismError``,
``SaslAuthenticationFailed``) and then raises only ``KafkaConnectionError("Unable to bootstrap
...")``, which a caller takes for an unreachable broker and retries until its timeout. When a
client that uses SASL cannot bootstrap, :func:`diagnose` opens one connection the way the client
does (TLS if configured, the version lookup, the SASL handshake and login) and
:func:`refusal` turns the broker's refusal into :class:`KafkaAuthError`, whose one-line message
names the options to fix (``kafka.sasl_mechanism``, ``kafka.sasl_username``, the password's
variable); the password is never shown. It is not transient: retrying cannot help.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    IllegalSaslStateError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from runtime.kafka.config import KafkaConfig, KafkaRefused

__all__ = ["KafkaAuthError", "diagnose", "refusal"]

log = logging.getLogger(__name__)

_MECHANISM = "kafka.sasl_mechanism (--kafka-sasl-mechanism)"
_USER = "kafka.sasl_username (--kafka-sasl-username)"
_PASSWORD = "kafka.sasl_password (SHOAL_KAFKA_SASL_PASSWORD)"


class KafkaAuthError(KafkaRefused):
    """The brokers refused the SASL mechanism or login; retrying cannot help. The message names
    the options to fix."""


def refusal(exc: BaseException, config: KafkaConfig, server: str) -> KafkaAuthError | None:
    """The :class:`KafkaAuthError` a connection failure ``exc`` of ``config`` at ``server``
    means, or ``None`` when it is no SASL refusal (a pure rule, on aiokafka's own errors)."""
    if config.sasl_mechanism is None:
        return None
    mechanism, user = config.sasl_mechanism, config.sasl_username
    detail = _detail(exc)
    if isinstance(exc, UnsupportedSaslMechanismError | AuthenticationMethodNotSupported):
        error = KafkaAuthError(
            f"Kafka at {server} does not accept SASL mechanism {mechanism}{detail}: set "
            f"{_MECHANISM} to one its listener enables, or give the listener that enables it"
        )
    elif isinstance(
        exc, SaslAuthenticationFailed | AuthenticationFailedError | IllegalSaslStateError
    ):
        error = KafkaAuthError(
            f"Kafka at {server} refused the SASL login of user {user!r} with {mechanism}"
            f"{detail}: check {_USER}, {_PASSWORD} and {_MECHANISM}"
        )
    else:
        return None
    error.__cause__ = exc
    return error


def _detail(exc: BaseException) -> str:
    """The broker's own words, when aiokafka kept them (not just the connection's repr)."""
    text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    code = getattr(exc, "message", None)
    if text:
        return f" ({text})"
    return f" ({code})" if isinstance(code, str) else ""


async def diagnose(config: KafkaConfig, *, timeout_s: float = 5.0) -> KafkaAuthError | None:
    """A :class:`KafkaAuthError` if a bootstrap server refuses ``config``'s SASL mechanism or
    login, else ``None`` (no SASL, the login works, or the server cannot be reached: then the
    failure is not about SASL)."""
    if config.sasl_mechanism is None:
        return None
    context = config.ssl_context()
    for server in config.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            async with asyncio.timeout(timeout_s):
                conn = await create_conn(
                    host.strip("[]"),
                    int(port),
                    client_id=config.client_id,
                    request_timeout_ms=int(timeout_s * 1000),
                    ssl_context=context,
                    security_protocol=config.security_protocol,
                    sasl_mechanism=config.sasl_mechanism,
                    sasl_plain_username=config.sasl_username,
                    sasl_plain_password=config.sasl_password,
                )
        except Exception as exc:  # classified below; anything else is not about SASL
            refused = refusal(exc, config, server.strip())
            if refused is not None:
                return refused
            log.debug("SASL check: %s: %r", server, exc)
            continue
        conn.close()
    return None
