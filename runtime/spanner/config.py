"""Connection settings for a Spanner database and its change stream.

Nothing here knows about the emulator binary: ``emulator_host`` only says "talk plain-text gRPC to
this host:port with anonymous credentials" (the emulator, or a mock server in tests). Without it the
client uses Application Default Credentials, or ``credentials_file`` (a service-account key).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class SpannerConfig(msgspec.Struct, frozen=True, kw_only=True):
    project: str
    instance: str
    database: str
    change_stream: str
    credentials_file: str | None = None  # service-account key file; None: ADC
    emulator_host: str | None = None  # "127.0.0.1:9010": plain-text gRPC, anonymous credentials
    disable_builtin_metrics: bool = True  # otherwise the client starts a Cloud Monitoring exporter
    heartbeat_ms: int = 1000  # heartbeat_milliseconds of every partition query
    # each partition query spans at most this many seconds of commit time (None: to the
    # partition's end); see SpannerSource
    query_window_s: float | None = None
    # read only commit time at least this many seconds old, polling (the emulator: see
    # SpannerSource); None: read live
    trail_s: float | None = None
    # RequestOptions.priority of the change-stream queries (None: Spanner's default, HIGH)
    rpc_priority: Literal["LOW", "MEDIUM", "HIGH"] | None = None
    # fine-grained access control: the database role the connection acts as (None: the
    # credentials' own permissions)
    database_role: str | None = None

    def __post_init__(self) -> None:
        if not self.change_stream.replace("_", "").isalnum():
            # The stream name is spliced into the SQL text (READ_<stream>): keep it an identifier.
            raise ValueError(
                f"change stream name must be an identifier, got {self.change_stream!r}"
            )
        if self.heartbeat_ms <= 0:
            raise ValueError(f"heartbeat_ms must be positive, got {self.heartbeat_ms}")
        if self.query_window_s is not None and not self.query_window_s > 0:
            raise ValueError(f"query_window_s must be positive, got {self.query_window_s}")
        if self.trail_s is not None and not self.trail_s > 0:
            raise ValueError(f"trail_s must be positive, got {self.trail_s}")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``google.cloud.spanner.Client`` / ``spanner_v1.AsyncClient``."""
        kwargs: dict[str, Any] = {
            "project": self.project,
            "disable_builtin_metrics": self.disable_builtin_metrics,
        }
        if self.emulator_host is not None:
            from google.auth import credentials

            anonymous: Any = credentials.AnonymousCredentials
            kwargs["credentials"] = anonymous()
            kwargs["client_options"] = {"api_endpoint": self.emulator_host}
        elif self.credentials_file is not None:
            from google.oauth2 import service_account

            key_file_credentials: Any = service_account.Credentials
            kwargs["credentials"] = key_file_credentials.from_service_account_file(
                self.credentials_file
            )
        return kwargs
