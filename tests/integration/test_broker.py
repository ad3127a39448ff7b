"""The embedded broker launcher (``runtime.kafka.broker``): start, readiness, port-taken detection,
retry on another port, stop."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import runtime.kafka.broker as broker_module
from runtime.kafka.broker import (
    BrokerError,
    EmbeddedBroker,
    broker_binary,
    probe_metadata,
)
from runtime.net import free_port

pytestmark = pytest.mark.kafka


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port with a listening socket on it (not a Kafka broker)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_start_answers_kafka_and_stop_frees_the_port(tmp_path: Path) -> None:
    log_path = tmp_path / "broker.log"
    broker = EmbeddedBroker(log_path=log_path)
    broker.start()  # how fast is bench's business; start() itself bounds the wait
    try:
        assert broker.pid > 0
        assert broker.bootstrap == f"127.0.0.1:{broker.port}"
        assert probe_metadata("127.0.0.1", broker.port) == 1
        assert "listening on" in log_path.read_text()
        with pytest.raises(BrokerError, match="already started"):
            broker.start()
    finally:
        broker.stop()
    assert not broker.running
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", broker.port), timeout=1):
        pass
    broker.stop()  # idempotent
    with pytest.raises(BrokerError, match="not started"):
        _ = broker.pid


def test_port_taken_is_detected(taken_port: int) -> None:
    broker = EmbeddedBroker(port=taken_port, start_timeout_s=5)
    with pytest.raises(BrokerError, match=rf"port {taken_port}: the broker exited") as info:
        broker.start()
    assert "Address in use" in str(info.value)  # the broker's log tail is quoted
    assert broker.start_failures == 1
    assert not broker.running


def test_retries_on_another_port(taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ports = iter([taken_port])
    monkeypatch.setattr(
        broker_module, "free_port", lambda host="": next(ports, None) or free_port()
    )
    with EmbeddedBroker() as broker:
        assert broker.port != taken_port
        assert broker.start_failures == 1
        assert probe_metadata("127.0.0.1", broker.port) == 1


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    broker = EmbeddedBroker(binary=str(tmp_path / "no-such-tansu"), attempts=1)
    with pytest.raises(BrokerError, match="cannot execute"):
        broker.start()


def _warnings_of(action: Callable[[], None]) -> list[str]:
    """The warnings the broker module logs while ``action`` runs. A handler of the test's own
    on the broker's logger: pytest's caplog sits on the root logger, whose handlers an earlier
    in-process run of the command line may have replaced."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(broker_module.__name__)
    logger.addHandler(handler)
    try:
        action()
    finally:
        logger.removeHandler(handler)
    return seen


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    """A broker that does not end on SIGTERM within the grace is killed and reaped. Tansu
    installs its own SIGTERM handler, so the broker runs under a shell that ignores SIGTERM (the
    signal stop sends goes to that shell); SIGKILL takes the shell and the broker under it."""
    wrapper = tmp_path / "tansu-ignoring-sigterm"
    wrapper.write_text(f"#!/bin/sh\ntrap '' TERM\n'{broker_binary()}' \"$@\" &\nwait $!\n")
    wrapper.chmod(0o755)
    broker = EmbeddedBroker(binary=str(wrapper), stop_timeout_s=0.2)
    broker.start()
    pid, port = broker.pid, broker.port
    seen = _warnings_of(broker.stop)
    assert not broker.running
    assert f"embedded broker pid {pid} ignored SIGTERM for 0.2 s; killing it" in seen
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process any more
        os.kill(pid, 0)
    with pytest.raises(OSError):  # the broker under the shell went with it
        probe_metadata("127.0.0.1", port, timeout=0.5)


def test_stop_of_a_frozen_broker_does_not_wait_for_the_grace() -> None:
    """A broker frozen with SIGSTOP (an outage drill) is continued so that it acts on SIGTERM:
    stop takes well under the grace and kills nothing."""
    broker = EmbeddedBroker(stop_timeout_s=30.0)
    broker.start()
    pid = broker.pid
    os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    seen = _warnings_of(broker.stop)
    assert time.monotonic() - began < 10.0
    assert not broker.running
    assert not [line for line in seen if "killing it" in line]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="attempts"):
        EmbeddedBroker(attempts=0)
    with pytest.raises(ValueError, match="positive"):
        EmbeddedBroker(start_timeout_s=0)


@pytest.mark.asyncio
async def test_async_context_manager() -> None:
    async with EmbeddedBroker() as broker:
        pid = broker.pid
        assert probe_metadata("127.0.0.1", broker.port) == 1
    assert not broker.running
    assert repr(broker) == "EmbeddedBroker(stopped)"
    assert pid > 0
