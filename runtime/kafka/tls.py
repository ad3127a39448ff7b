"""Why a TLS connection to Kafka failed, in words an operator can act on.

aiokafka logs a failed TLS handshake and then raises only ``KafkaConnectionError("Unable to
bootstrap ...")``: the certificate problem is gone from the exception, and a caller retrying
"unreachable" brokers would retry an untrusted certificate until its timeout. Two checks open one
TLS connection to each bootstrap server with the client's own TLS context and turn what cannot
work into :class:`KafkaTlsError`, whose one-line message names the option to fix:

* :func:`preflight`, before a client's first connection (once per process and settings): a
  listener that speaks plaintext Kafka would keep aiokafka's TLS handshake waiting for its whole
  request timeout (the embedded broker waits for the rest of a "request" as long as a TLS hello
  makes it look), each attempt, so the start took 41 s to fail as "unreachable"; a handshake that
  does not complete within a few seconds is followed by a plaintext Kafka request, and an answer
  means a plaintext listener;
* :func:`diagnose`, when a client that uses SSL could not bootstrap: a verification failure (the
  CA, the host name), a handshake refused, a plaintext listener.

It is not transient: retrying cannot help (its cause is the ``ssl`` error, not a connection
error). A server that cannot be reached at all is left to the caller's retries.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from aiokafka.conn import create_conn

from runtime.kafka.config import KafkaConfig, KafkaRefused

__all__ = ["KafkaTlsError", "diagnose", "preflight"]

log = logging.getLogger(__name__)


class KafkaTlsError(KafkaRefused):
    """The brokers' TLS certificate is not trusted or does not name the host, or the listener
    does not speak TLS; retrying cannot help. The message names the option to fix."""


def _servers(config: KafkaConfig) -> list[tuple[str, int]]:
    out = []
    for server in config.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


# the TLS settings whose listeners completed a handshake in this process (preflight)
_HANDSHAKE_OK: set[tuple[str | None, ...]] = set()


async def preflight(config: KafkaConfig, *, timeout_s: float = 3.0) -> None:
    """Before a TLS client connects: raise :class:`KafkaTlsError` if a bootstrap server's
    certificate fails verification, refuses the handshake, or the server answers plaintext
    Kafka. Once every server completed a handshake, later calls with the same settings return
    at once; a server that cannot be reached is left to the client (and checked again next
    time)."""
    context = config.ssl_context()
    if context is None:
        return
    key = (
        config.bootstrap_servers,
        config.security_protocol,
        config.ssl_cafile,
        config.ssl_certfile,
        config.ssl_keyfile,
    )
    if key in _HANDSHAKE_OK:
        return
    all_ok = True
    for host, port in _servers(config):
        verdict = await _handshake(config, context, host, port, timeout_s)
        if isinstance(verdict, KafkaTlsError):
            raise verdict from verdict.__cause__
        all_ok = all_ok and verdict
    if all_ok:
        _HANDSHAKE_OK.add(key)


async def diagnose(config: KafkaConfig, *, timeout_s: float = 5.0) -> KafkaTlsError | None:
    """A :class:`KafkaTlsError` if a bootstrap server's TLS handshake fails verification with
    ``config``'s TLS context, is refused, or meets a plaintext listener; else ``None`` (no SSL,
    the handshake works, or the server cannot be reached at all: then the failure is not about
    TLS)."""
    context = config.ssl_context()
    if context is None:
        return None
    for host, port in _servers(config):
        verdict = await _handshake(config, context, host, port, timeout_s)
        if isinstance(verdict, KafkaTlsError):
            return verdict
    return None


async def _handshake(
    config: KafkaConfig, context: ssl.SSLContext, host: str, port: int, timeout_s: float
) -> KafkaTlsError | bool:
    """One TLS handshake with ``host:port``: True if it completed, False if the server could
    not be reached (or stalled, and is no plaintext Kafka either), else what is wrong."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as exc:
        log.debug("TLS check: %s:%d not reachable (%r)", host, port, exc)
        return False
    try:
        async with asyncio.timeout(timeout_s):
            await writer.start_tls(context, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        _close(writer)
        return _verification(exc, host, port)
    except ssl.SSLError as exc:
        _close(writer)
        if await _plaintext_kafka(config, host, port, timeout_s):
            return _plaintext(config, host, port, exc)
        error = KafkaTlsError(
            f"TLS handshake with Kafka at {host}:{port} failed ({exc.reason or exc}); is it a "
            "TLS listener? (--kafka-security-protocol SSL/SASL_SSL needs one)"
        )
        error.__cause__ = exc
        return error
    except (OSError, TimeoutError) as exc:  # stalled or cut: a plaintext listener?
        _close(writer)
        if await _plaintext_kafka(config, host, port, timeout_s):
            return _plaintext(config, host, port, exc)
        log.debug("TLS check: no handshake with %s:%d (%r)", host, port, exc)
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ssl.SSLError) as exc:
        log.debug("TLS check: closing %s:%d: %r", host, port, exc)
    return True


def _close(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


async def _plaintext_kafka(config: KafkaConfig, host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers a plaintext Kafka request (ApiVersions)."""
    try:
        async with asyncio.timeout(timeout_s):
            conn = await create_conn(
                host,
                port,
                client_id=config.client_id,
                request_timeout_ms=int(timeout_s * 1000),
                security_protocol="PLAINTEXT",
            )
    except Exception as exc:  # anything but an answer: not a plaintext Kafka listener
        log.debug("TLS check: %s:%d does not answer plaintext Kafka either (%r)", host, port, exc)
        return False
    conn.close()
    return True


def _plaintext(config: KafkaConfig, host: str, port: int, exc: BaseException) -> KafkaTlsError:
    plain = "SASL_PLAINTEXT" if config.security_protocol == "SASL_SSL" else "PLAINTEXT"
    error = KafkaTlsError(
        f"Kafka at {host}:{port} speaks plaintext, not TLS: kafka.security_protocol "
        f"{config.security_protocol} (--kafka-security-protocol) needs a TLS listener; use "
        f"{plain} for this one, or give the brokers' TLS listener in --kafka-bootstrap-servers"
    )
    error.__cause__ = exc
    return error


def _verification(exc: ssl.SSLCertVerificationError, host: str, port: int) -> KafkaTlsError:
    reason = exc.verify_message or exc.reason or str(exc)
    if exc.verify_code in _HOSTNAME_MISMATCH:
        hint = (
            f"the brokers' certificate does not name {host!r}: use a host name the "
            "certificate lists in --kafka-bootstrap-servers (kafka.bootstrap_servers), "
            "or have the certificate include it"
        )
    else:
        hint = (
            "the brokers' certificate is not signed by a CA in --kafka-ssl-cafile "
            "(kafka.ssl_cafile): give the CA bundle that signed it"
        )
    error = KafkaTlsError(f"TLS to Kafka at {host}:{port} refused: {reason}; {hint}")
    error.__cause__ = exc
    return error


# X509_V_ERR_HOSTNAME_MISMATCH (62) and X509_V_ERR_IP_ADDRESS_MISMATCH (64) of OpenSSL
_HOSTNAME_MISMATCH = frozenset({62, 64})
