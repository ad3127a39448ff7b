"""Why a TLS connection to Kafka failed, in words an operator can act on.

aiokafka logs a failed TLS handshake and then raises only ``KafkaConnectionError("Unable to
bootstrap ...")``: the certificate problem is gone from the exception, and a caller retrying
"unreachable" brokers would retry an untrusted certificate until its timeout. When a client that
uses SSL cannot bootstrap, :func:`diagnose` opens one TLS connection to each bootstrap server with
the client's own TLS context and turns a verification failure into :class:`KafkaTlsError`, whose
one-line message names the option to fix. It is not transient: retrying cannot help (its cause is
the ``ssl`` error, not a connection error).
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from runtime.kafka.config import KafkaAdapterError, KafkaConfig

__all__ = ["KafkaTlsError", "diagnose"]

log = logging.getLogger(__name__)


class KafkaTlsError(KafkaAdapterError):
    """The brokers' TLS certificate is not trusted or does not name the host; retrying cannot
    help. The message names the option to fix."""


def _servers(config: KafkaConfig) -> list[tuple[str, int]]:
    out = []
    for server in config.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


async def diagnose(config: KafkaConfig, *, timeout_s: float = 5.0) -> KafkaTlsError | None:
    """A :class:`KafkaTlsError` if a bootstrap server's TLS handshake fails verification with
    ``config``'s TLS context, else ``None`` (no SSL, the handshake works, or the server cannot be
    reached at all: then the failure is not about TLS)."""
    context = config.ssl_context()
    if context is None:
        return None
    for host, port in _servers(config):
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(
                    host, port, ssl=context, server_hostname=host
                )
        except ssl.SSLCertVerificationError as exc:
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
        except ssl.SSLError as exc:
            error = KafkaTlsError(
                f"TLS handshake with Kafka at {host}:{port} failed ({exc.reason or exc}); is it a "
                "TLS listener? (--kafka-security-protocol SSL/SASL_SSL needs one)"
            )
            error.__cause__ = exc
            return error
        except (OSError, TimeoutError) as exc:
            log.debug("TLS diagnosis: %s:%d not reachable (%r)", host, port, exc)
            continue
        writer.close()
        try:
            await writer.wait_closed()
        except (OSError, ssl.SSLError) as exc:
            log.debug("TLS diagnosis: closing %s:%d: %r", host, port, exc)
    return None


# X509_V_ERR_HOSTNAME_MISMATCH (62) and X509_V_ERR_IP_ADDRESS_MISMATCH (64) of OpenSSL
_HOSTNAME_MISMATCH = frozenset({62, 64})
