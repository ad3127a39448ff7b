"""How shoal reaches Kafka: :class:`KafkaConfig` (bootstrap servers, SASL/SSL, group timeouts),
validated up front, and the keyword arguments every aiokafka client is built with. Its ``repr``
never shows a secret."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaAdapterError(RuntimeError):
    """A Kafka adapter could not do what was asked; the message says what and why."""


class KafkaSettingError(KafkaAdapterError):
    """A Kafka setting cannot work as given, found before connecting: a TLS file that cannot be
    read or holds no certificate, a key its password does not open. The message names the
    option (the CLI exits 2); retrying cannot help."""


class KafkaRefused(KafkaAdapterError):
    """The brokers refused this client's settings: an untrusted certificate, a plaintext
    listener for a TLS client, a SASL login or mechanism refused. The message names the option
    to fix; retrying cannot help (the CLI stops at once, exit 1)."""


class KafkaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach Kafka. ``session_timeout_ms``/``heartbeat_interval_ms`` are the heartbeat-topic
    group's; the embedded broker is fine with 4000/500 (:meth:`embedded`), a real Kafka refuses
    sessions under its ``group.min.session.timeout.ms`` (6000 by default). The rebalance timeout
    is twice the session (:class:`runtime.kafka.membership.KafkaMembership`); why these values
    keep every survivor's lease through a rebalance: docs/operations.md ("Group timeouts")."""

    bootstrap_servers: str
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = None
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    request_timeout_ms: int = 15_000
    replication_factor: int = 1  # for the topics shoal creates; use 3 on a production cluster
    client_id: str = "shoal"

    @classmethod
    def embedded(cls, bootstrap_servers: str) -> KafkaConfig:
        """Settings for the embedded broker: plaintext, fast group timeouts (4000/500 ms).

        The embedded broker holds a JoinGroup for about half the session timeout, in steps of a
        second (2 s for a session of 3000 or 4000 ms), and a follower's SyncGroup until the
        leader's, whose JoinGroup may start a heartbeat interval later; a member's lease covers
        ``session - session/6`` from its last heartbeat. 4000/500 leaves ~1.3 s of it after the
        rebalance; 3000/1000 left none, so every survivor stopped reading in every rebalance."""
        return cls(
            bootstrap_servers=bootstrap_servers,
            session_timeout_ms=4_000,
            heartbeat_interval_ms=500,
            request_timeout_ms=10_000,
        )

    def __post_init__(self) -> None:
        servers = [s.strip() for s in self.bootstrap_servers.split(",")]
        if not servers or any(not s for s in servers):
            raise ValueError(
                f"bootstrap_servers must be 'host:port[,host:port...]', got {self.bootstrap_servers!r}"
            )
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"bootstrap server {server!r} is not 'host:port'")
        for name in (
            "session_timeout_ms",
            "heartbeat_interval_ms",
            "request_timeout_ms",
            "replication_factor",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below "
                f"session_timeout_ms ({self.session_timeout_ms}); a third of it is usual"
            )
        sasl = self.security_protocol.startswith("SASL_")
        if sasl:
            if self.sasl_mechanism is None:
                raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism")
            if not self.sasl_username or self.sasl_password is None:
                raise ValueError(
                    f"SASL mechanism {self.sasl_mechanism} needs sasl_username and sasl_password"
                )
        elif self.sasl_mechanism is not None or self.sasl_username or self.sasl_password:
            raise ValueError(
                f"SASL settings are given but security_protocol is {self.security_protocol}; "
                "use SASL_PLAINTEXT or SASL_SSL"
            )
        uses_ssl = self.security_protocol in ("SSL", "SASL_SSL")
        ssl_files = (self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
        if not uses_ssl and any(f is not None for f in ssl_files):
            raise ValueError(
                f"SSL files are given but security_protocol is {self.security_protocol}; "
                "use SSL or SASL_SSL"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together (client certificate)")

    def __repr__(self) -> str:
        shown = []
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if field in ("sasl_password", "ssl_keyfile_password") and value is not None:
                value = "***"
            if value != getattr(_DEFAULTS, field, None) or field == "bootstrap_servers":
                shown.append(f"{field}={value!r}")
        return f"KafkaConfig({', '.join(shown)})"

    __str__ = __repr__

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context, or ``None`` without SSL: the system's CAs or
        ``ssl_cafile``, host names checked, and the client certificate if given (as aiokafka's
        ``create_ssl_context``). A file that is missing, holds no certificate or key, or a key
        the password does not open is :class:`KafkaSettingError` naming the option; an
        encrypted key without a password is refused, never prompted for on a terminal."""
        if self.security_protocol not in ("SSL", "SASL_SSL"):
            return None
        for label, path in (
            ("ssl_cafile", self.ssl_cafile),
            ("ssl_certfile", self.ssl_certfile),
            ("ssl_keyfile", self.ssl_keyfile),
        ):
            if path is not None and not Path(path).is_file():
                raise KafkaSettingError(f"{_file(label, path)} does not exist or is not a file")
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise KafkaSettingError(
                f"{_file('ssl_cafile', self.ssl_cafile)} holds no CA certificate in PEM "
                f"format{_because(exc)}: give the CA bundle that signed the brokers' "
                "certificates"
            ) from exc
        if self.ssl_certfile is not None:
            asked: list[bool] = []

            def password() -> str:
                asked.append(True)
                return self.ssl_keyfile_password or ""

            try:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password)
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise KafkaSettingError(self._client_key_problem(exc, bool(asked))) from exc
        return context

    def _client_key_problem(self, exc: BaseException, asked_password: bool) -> str:
        """Which of the client certificate, its key and the key's password is wrong."""
        certfile, keyfile = self.ssl_certfile, self.ssl_keyfile
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            probe.load_verify_locations(cafile=certfile)
        except (ssl.SSLError, OSError, ValueError):
            return (
                f"{_file('ssl_certfile', certfile)} holds no certificate in PEM "
                f"format{_because(exc)}"
            )
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            return (
                f"{_file('ssl_keyfile', keyfile)} is not the key of "
                f"{_file('ssl_certfile', certfile)}"
            )
        if asked_password and self.ssl_keyfile_password is None:
            return (
                f"{_file('ssl_keyfile', keyfile)} is encrypted: give its password in "
                f"{_option('ssl_keyfile_password')} (SHOAL_KAFKA_SSL_KEYFILE_PASSWORD)"
            )
        if asked_password:
            return (
                f"{_file('ssl_keyfile', keyfile)} could not be decrypted with "
                f"{_option('ssl_keyfile_password')}: wrong password"
            )
        return f"{_file('ssl_keyfile', keyfile)} holds no private key in PEM format{_because(exc)}"

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments common to aiokafka's producer, consumer and admin client."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        context = self.ssl_context()
        if context is not None:
            kwargs["ssl_context"] = context
        if self.sasl_mechanism is not None:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        return kwargs

    def with_client_id(self, client_id: str) -> KafkaConfig:
        return msgspec.structs.replace(self, client_id=client_id)

    @classmethod
    def from_mapping(cls, values: Mapping[str, str]) -> KafkaConfig:
        """Build from strings (a config file section, environment variables); field names as
        in this class. Unknown names are refused, so a typo does not go unnoticed."""
        unknown = sorted(set(values) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(
                f"unknown Kafka setting(s) {unknown}; known: {sorted(cls.__struct_fields__)}"
            )
        try:
            return msgspec.convert(dict(values), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid Kafka settings: {exc}") from exc

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = "SHOAL_KAFKA_"
    ) -> KafkaConfig:
        """Build from ``SHOAL_KAFKA_<FIELD>`` variables, e.g. ``SHOAL_KAFKA_BOOTSTRAP_SERVERS``,
        ``SHOAL_KAFKA_SASL_PASSWORD``, ``SHOAL_KAFKA_SESSION_TIMEOUT_MS``."""
        env = os.environ if environ is None else environ
        return cls.from_mapping(
            {
                key[len(prefix) :].lower(): value
                for key, value in env.items()
                if key.startswith(prefix)
            }
        )


_DEFAULTS: Final = KafkaConfig(bootstrap_servers="localhost:9092")


def _option(field: str) -> str:
    """A :class:`KafkaConfig` field as the command line's option: key and flag."""
    return f"kafka.{field} (--kafka-{field.replace('_', '-')})"


def _file(field: str, path: str | None) -> str:
    """A file option with its value: ``kafka.ssl_cafile '/etc/ca.pem' (--kafka-ssl-cafile)``."""
    return f"kafka.{field} {path!r} (--kafka-{field.replace('_', '-')})"


def _because(exc: BaseException) -> str:
    """`` (<OpenSSL's reason or the OS error>)``, or nothing when OpenSSL gives no reason."""
    if isinstance(exc, ssl.SSLError):
        return f" ({exc.reason})" if exc.reason else ""
    if isinstance(exc, OSError) and exc.strerror:
        return f" ({exc.strerror})"
    return f" ({exc})" if str(exc) else ""
