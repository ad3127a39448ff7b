"""``runtime.compat``: every use of a library's private parts checks the installed version and
fails clearly on one it was not written for; the patches themselves do what they say; importing
``runtime`` changes nothing in the process."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from runtime import compat
from runtime.compat import AIOKAFKA, SPANNER, IncompatibleLibraryError, Supported
from tests.helpers import REPO as REPO_ROOT


@pytest.mark.parametrize("library", [AIOKAFKA, SPANNER], ids=lambda lib: lib.distribution)
def test_the_installed_and_pinned_versions_are_the_supported_series(library: Supported) -> None:
    """What is installed (read from the package metadata here, not through compat) belongs to
    the supported series, and pyproject.toml pins exactly those series: a bump of the pin alone
    fails here instead of at the first use of a private part."""
    installed = importlib.metadata.version(library.distribution)
    assert compat.supports(library, installed), installed
    compat.check(library, "test")  # the check a private use makes passes on what is installed
    pins = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = sorted(
        pin.split("==", 1)[1].removesuffix(".*")
        for pin in pins
        if pin.split("==", 1)[0].strip() == library.distribution
    )
    assert pinned == sorted(library.series), pins


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.14", True),
        ("0.14.0", True),
        ("0.14.2rc1", True),
        ("0.140.0", False),
        ("0.13.9", False),
        ("1.14.0", False),
        ("0.15.0", False),
    ],
)
def test_supported_series(version: str, supported: bool) -> None:
    assert compat.supports(Supported("x", ("0.14",)), version) is supported


def installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    monkeypatch.setattr(compat, "installed_version", lambda distribution: versions[distribution])


class FakeCoordinator:
    def __init__(self, results: list[bool]) -> None:
        self.member_id = "m-1"
        self._results = results

    async def _do_heartbeat(self) -> bool:
        return self._results.pop(0)


def test_observe_heartbeats_reports_send_time_and_success() -> None:
    coordinator = FakeCoordinator([True, False])
    ticks = iter([10.0, 11.5])
    seen: list[tuple[float, bool]] = []
    compat.observe_heartbeats(coordinator, lambda: next(ticks), lambda s, ok: seen.append((s, ok)))

    async def beat_twice() -> list[bool]:
        return [await coordinator._do_heartbeat(), await coordinator._do_heartbeat()]

    assert asyncio.run(beat_twice()) == [True, False]
    assert seen == [(10.0, True), (11.5, False)]


def test_observe_heartbeats_refuses_another_aiokafka(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, {"aiokafka": "0.15.1"})
    coordinator = FakeCoordinator([True])
    original = coordinator._do_heartbeat
    with pytest.raises(IncompatibleLibraryError) as caught:
        compat.observe_heartbeats(coordinator, lambda: 0.0, lambda s, ok: None)
    message = str(caught.value)
    assert "aiokafka 0.15.1 is installed" in message
    assert "GroupCoordinator._do_heartbeat" in message
    assert "aiokafka 0.14.* only" in message
    assert "runtime/compat.py" in message
    assert coordinator._do_heartbeat == original  # not patched


def test_observe_heartbeats_without_the_private_method() -> None:
    with pytest.raises(IncompatibleLibraryError, match=r"has no GroupCoordinator._do_heartbeat"):
        compat.observe_heartbeats(object(), lambda: 0.0, lambda s, ok: None)


def test_group_coordinator_and_leave_group_refuse_another_aiokafka(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed(monkeypatch, {"aiokafka": "0.13.0"})
    with pytest.raises(IncompatibleLibraryError, match=r"AIOKafkaConsumer._coordinator"):
        compat.group_coordinator(object())
    with pytest.raises(IncompatibleLibraryError, match=r"_send_req"):
        asyncio.run(compat.send_leave_group(object(), "group"))


@pytest.mark.parametrize(
    "use",
    [
        lambda: compat.merge_function(),
        lambda: compat.response_iterator(object()),
        lambda: asyncio.run(compat.cancel_stream(object())),
        lambda: compat.database_transport(object()),
        lambda: compat.admin_transports(object()),
    ],
)
def test_spanner_parts_refuse_another_client(monkeypatch: pytest.MonkeyPatch, use: Any) -> None:
    installed(monkeypatch, {"google-cloud-spanner": "3.72.0"})
    with pytest.raises(
        IncompatibleLibraryError, match=r"google-cloud-spanner 3\.72\.0 is installed"
    ):
        use()


def test_merge_function_is_the_clients() -> None:
    from google.cloud.spanner_v1._async import streamed

    assert compat.merge_function() is streamed._merge_by_type


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeResultSet:
    """Shaped as the client's: the call is the ``iterator`` local of a suspended generator."""

    def __init__(self, call: FakeCall | None) -> None:
        self.closed = False
        self._response_iterator: Any = self._responses(call)

    async def _responses(self, call: FakeCall | None) -> AsyncGenerator[int, None]:
        iterator = call
        try:
            for n in range(3):
                yield n
        finally:
            self.closed = iterator is call


def test_cancel_stream_cancels_the_call_in_the_suspended_generator() -> None:
    async def stop_after_one(result_set: FakeResultSet) -> int:
        first: int = await anext(compat.response_iterator(result_set))
        await compat.cancel_stream(result_set)
        return first

    call = FakeCall()
    result_set = FakeResultSet(call)
    assert asyncio.run(stop_after_one(result_set)) == 0
    assert call.cancelled
    assert result_set.closed


def test_cancel_stream_of_a_finished_or_unstarted_stream() -> None:
    async def drain(result_set: FakeResultSet) -> list[int]:
        got = [n async for n in compat.response_iterator(result_set)]
        await compat.cancel_stream(result_set)
        return got

    call = FakeCall()
    assert asyncio.run(drain(FakeResultSet(call))) == [0, 1, 2]
    assert not call.cancelled  # it had ended: nothing to cancel
    unstarted = FakeResultSet(call)
    assert unstarted._response_iterator.ag_frame is not None
    asyncio.run(compat.cancel_stream(unstarted))  # never iterated: no 'iterator' local yet
    assert not call.cancelled
    assert unstarted._response_iterator.ag_frame is None  # closed


def test_transports() -> None:
    class Api:
        def __init__(self, name: str) -> None:
            self.transport = name

    class Client:
        _instance_admin_api = Api("instance")
        _database_admin_api = None

    class Database:
        _spanner_api = Api("data")

    assert compat.admin_transports(Client()) == ["instance"]
    assert compat.database_transport(Database()) == "data"
    assert compat.database_transport(object()) is None


def test_disable_grpc_fork_support_keeps_a_users_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compat.GRPC_FORK_SUPPORT, raising=False)
    compat.disable_grpc_fork_support()
    assert os.environ[compat.GRPC_FORK_SUPPORT] == "false"
    monkeypatch.setenv(compat.GRPC_FORK_SUPPORT, "1")
    compat.disable_grpc_fork_support()
    assert os.environ[compat.GRPC_FORK_SUPPORT] == "1"


def test_importing_runtime_changes_no_environment_variable() -> None:
    """Every module of ``runtime`` imported in a fresh process; the environment is compared."""
    script = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import runtime
names = [m.name for m in pkgutil.walk_packages(runtime.__path__, "runtime.")]
for name in names:
    importlib.import_module(name)
after = dict(os.environ)
print(json.dumps({"names": names, "changed": sorted(set(before.items()) ^ set(after.items()))}))
"""
    env = {k: v for k, v in os.environ.items() if k != compat.GRPC_FORK_SUPPORT}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"runtime.compat", "runtime.kafka.membership", "runtime.spanner.reader"} <= set(
        result["names"]
    )
    assert result["changed"] == []
