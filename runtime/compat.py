"""Every place where shoal relies on a library's private parts, in one module, each checked against
the library versions it was written for.

Where a library offers no public way to do something shoal needs, the code that reaches into its
private attributes lives here, behind a small function. Each function first checks the installed
version of the library (:func:`check`) and raises :class:`IncompatibleLibraryError` on a version
it was not written for, naming the library, the installed and the supported versions, instead of
misbehaving later in a way that is hard to trace. To support a new version, read the function
against the library's new source and add the version to :data:`AIOKAFKA` or :data:`SPANNER`.

aiokafka (:data:`AIOKAFKA`), used by :mod:`runtime.kafka.membership`:

* :func:`observe_heartbeats` wraps ``GroupCoordinator._do_heartbeat`` to learn when a heartbeat
  succeeds (aiokafka has no callback for it);
* :func:`observe_group_requests` wraps ``GroupCoordinator._send_req`` to learn the send time and
  the answer of every Heartbeat, JoinGroup and SyncGroup (the membership lease is built on them,
  :mod:`protocol.lease`);
* :func:`group_coordinator` is the consumer's ``_coordinator`` (generation, member id,
  ``request_rejoin``);
* :func:`send_leave_group` sends a LeaveGroup through the coordinator's ``_send_req`` (aiokafka
  sends none in generation 0, the embedded broker's first).

aiokafka, used by :mod:`runtime.kafka.synclog`: :func:`abandon_sends` fails a producer's
unacknowledged batches (``_message_accumulator.fail_all``) and drops its connections
(``client._conns``), so that its ``stop()`` does not wait for them (aiokafka's ``stop()``
flushes, for up to the request timeout, with no way to bound it).

google-cloud-spanner (:data:`SPANNER`), used by :mod:`runtime.spanner`:

* :func:`response_iterator` is a result set's ``_response_iterator`` (the stream of partial
  result sets, decoded by shoal's own decoder);
* :func:`merge_function` is ``_async.streamed._merge_by_type`` (joins chunked values);
* :func:`cancel_stream` cancels the gRPC call of a result set whose consumer stopped early: the
  call is the ``iterator`` local in the frame of the client's suspended generator;
* :func:`database_transport` and :func:`admin_transports` find the gRPC transports a database
  or a blocking client opened (no public ``close()`` reaches them).

pyspark (:data:`PYSPARK`), used by :mod:`runtime.spark.supervisor` and
:mod:`runtime.spark.session`:

* :func:`spark_jvm_running` tells whether pyspark holds a gateway to a JVM
  (``SparkContext._gateway``): only without one does a session start launch a JVM, whose
  settings then go in a file rather than on its command line;

* :func:`spark_jvm_process` is the JVM a local session's gateway launched
  (``SparkContext._gateway.proc``): whether it still runs tells a dead session from a failing job;
* :func:`spark_executor_count` counts a cluster application's executors (``_jsc``), to say
  why its jobs hang;
* :func:`forget_local_session` clears pyspark's class-level handles of a session whose JVM died
  (``SparkContext._gateway``, ``_jvm``, ``_active_spark_context``, ``SparkSession``'s instantiated
  and active session), so that the next ``getOrCreate()`` launches a new JVM;
* :func:`kill_launched_jvm` kills that JVM while a session start that ran past its time still
  holds ``SparkContext._lock``, so that the start fails and its thread ends.

And one process-wide setting of gRPC, applied where a Spanner client is created rather than at
import (importing :mod:`runtime` changes nothing): :func:`disable_grpc_fork_support`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, NamedTuple, cast

log = logging.getLogger(__name__)


class Supported(NamedTuple):
    """A library (its distribution name) and the release series (``major.minor``) whose private
    parts the functions here were written against."""

    distribution: str
    series: tuple[str, ...]


AIOKAFKA: Final = Supported("aiokafka", ("0.14",))
SPANNER: Final = Supported("google-cloud-spanner", ("3.71",))
PYSPARK: Final = Supported("pyspark", ("4.3",))


class IncompatibleLibraryError(RuntimeError):
    """An installed library is a version whose private parts shoal was not written against."""


@functools.cache
def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (read once)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise IncompatibleLibraryError(f"{distribution} is not installed") from exc


def supports(library: Supported, version: str) -> bool:
    """Whether ``version`` belongs to one of ``library``'s supported series (``0.14`` covers
    ``0.14``, ``0.14.0``, ``0.14.2rc1``, not ``0.140``)."""
    return any(version == s or version.startswith(s + ".") for s in library.series)


def check(library: Supported, use: str) -> None:
    """Raise :class:`IncompatibleLibraryError` unless the installed ``library`` is a supported
    version; ``use`` says which private part is about to be used, and what for."""
    version = installed_version(library.distribution)
    if not supports(library, version):
        series = ", ".join(f"{s}.*" for s in library.series)
        raise IncompatibleLibraryError(
            f"{library.distribution} {version} is installed, but shoal uses a private part of it "
            f"({use}) written against {library.distribution} {series} only. Install a supported "
            f"version (pyproject.toml pins it), or check runtime/compat.py against "
            f"{library.distribution} {version} and add it to the supported versions."
        )


def _missing(library: Supported, part: str) -> IncompatibleLibraryError:
    version = installed_version(library.distribution)
    return IncompatibleLibraryError(
        f"{library.distribution} {version} has no {part}, which shoal uses (runtime/compat.py); "
        f"it was written against {library.distribution} "
        f"{', '.join(s + '.*' for s in library.series)}"
    )


# -- aiokafka ------------------------------------------------------------------------------------


def group_coordinator(consumer: Any) -> Any:
    """The consumer's group coordinator (``AIOKafkaConsumer._coordinator``), or ``None`` before
    the consumer started."""
    check(AIOKAFKA, "AIOKafkaConsumer._coordinator")
    return consumer._coordinator


def observe_heartbeats(
    coordinator: Any, clock: Callable[[], float], on_heartbeat: Callable[[float, bool], None]
) -> None:
    """After each heartbeat ``coordinator`` sends, call ``on_heartbeat(sent, ok)``: ``sent`` is
    ``clock()`` just before it was sent, ``ok`` whether it succeeded. Wraps
    ``GroupCoordinator._do_heartbeat``, which returns that success."""
    check(AIOKAFKA, "GroupCoordinator._do_heartbeat, wrapped to observe heartbeats")
    original = getattr(coordinator, "_do_heartbeat", None)
    if original is None:
        raise _missing(AIOKAFKA, "GroupCoordinator._do_heartbeat")

    async def observed_heartbeat() -> bool:
        sent = clock()
        ok: bool = await original()
        on_heartbeat(sent, ok)
        return ok

    coordinator._do_heartbeat = observed_heartbeat


GROUP_REQUESTS: Final = ("heartbeat", "join", "sync")


def observe_group_requests(
    coordinator: Any,
    clock: Callable[[], float],
    on_answer: Callable[[str, float, int | None], None],
) -> None:
    """Before each Heartbeat, JoinGroup and SyncGroup the coordinator sends, call
    ``on_answer(kind, sent, None)`` (``kind`` one of :data:`GROUP_REQUESTS`); after it, call
    ``on_answer(kind, sent, error_code)`` with the answer's error code, or ``-1`` when no answer
    came (an error was raised: a timeout or a broken connection, which aiokafka re-raises or
    turns into a retry). ``sent`` is ``clock()`` just before sending. Wraps
    ``GroupCoordinator._send_req``, through which aiokafka sends all three (the rebalance code
    calls it as ``coordinator._send_req``, so an instance attribute takes effect)."""
    check(AIOKAFKA, "GroupCoordinator._send_req, wrapped to observe group requests")
    from aiokafka.protocol.group import HeartbeatRequest, JoinGroupRequest, SyncGroupRequest

    original = getattr(coordinator, "_send_req", None)
    if original is None:
        raise _missing(AIOKAFKA, "GroupCoordinator._send_req")
    kinds: tuple[tuple[type[Any], str], ...] = (
        (HeartbeatRequest, "heartbeat"),
        (JoinGroupRequest, "join"),
        (SyncGroupRequest, "sync"),
    )

    async def observed_send(request: Any) -> Any:
        kind = next((name for cls, name in kinds if isinstance(request, cls)), None)
        if kind is None:
            return await original(request)
        sent = clock()
        on_answer(kind, sent, None)
        try:
            response = await original(request)
        except BaseException:
            on_answer(kind, sent, -1)
            raise
        on_answer(kind, sent, int(response.error_code))
        return response

    coordinator._send_req = observed_send


async def send_heartbeat_aside(coordinator: Any) -> int | None:
    """Send one Heartbeat for the coordinator's member on a connection of its own (the client's
    default connection group, not the one aiokafka's JoinGroup and SyncGroup wait on) and return
    the answer's error code; ``None`` without a coordinator, member id or generation to send.
    Raises what ``AIOKafkaClient.send`` raises (a timeout, a broken connection)."""
    check(AIOKAFKA, "GroupCoordinator._client/coordinator_id/generation/member_id, to heartbeat")
    from aiokafka.protocol.group import HeartbeatRequest

    node = coordinator.coordinator_id
    generation = coordinator.generation
    member_id = coordinator.member_id
    if node is None or member_id == "" or generation is None or generation < 0:
        return None
    request = HeartbeatRequest(coordinator.group_id, generation, member_id)
    response = await coordinator._client.send(node, request)
    return int(response.error_code)


async def send_leave_group(coordinator: Any, group_id: str) -> None:
    """Send a LeaveGroup request for the coordinator's member (``GroupCoordinator._send_req``)."""
    check(AIOKAFKA, "GroupCoordinator._send_req, to send LeaveGroup")
    from aiokafka.protocol.group import LeaveGroupRequest

    await coordinator._send_req(LeaveGroupRequest(group_id, coordinator.member_id))


async def abort_connections(consumer: Any) -> None:
    """Close every connection of the consumer's client (``AIOKafkaClient._conns``) as broken:
    the requests in flight on them fail at once instead of at their timeout."""
    check(AIOKAFKA, "AIOKafkaClient._conns, to drop the connections")
    from aiokafka.conn import CloseReason

    closing = [
        c.close(reason=CloseReason.CONNECTION_BROKEN) for c in consumer._client._conns.values()
    ]
    await asyncio.gather(*closing)


async def abandon_sends(producer: Any, error: BaseException) -> int:
    """Fail every batch of ``producer`` not acknowledged yet with ``error`` and close its
    connections as broken; returns how many batches it failed."""
    check(AIOKAFKA, "the producer's message accumulator, to fail the sends in flight")
    from aiokafka.conn import CloseReason

    accumulator = producer._message_accumulator
    batches = [b for queued in accumulator._batches.values() for b in queued]
    batches += list(accumulator._pending_batches)
    for batch in batches:
        # expired: the sender fails a send of it that errs rather than queueing it again (a
        # batch failed here while its request is in flight would be queued again and then
        # removed twice from the accumulator's in-flight set)
        batch._ttl = -1.0
    requeue = accumulator.reenqueue

    def reenqueue(batch: Any) -> None:
        # a send that erred before the batches expired is queued again after its backoff:
        # an abandoned batch (its future failed below) is not
        if not batch.future.done():
            requeue(batch)

    accumulator.reenqueue = reenqueue
    accumulator.fail_all(error)
    closing = [
        c.close(reason=CloseReason.CONNECTION_BROKEN) for c in producer.client._conns.values()
    ]
    await asyncio.gather(*closing)
    return len(batches)


# -- pyspark -------------------------------------------------------------------------------------


def spark_jvm_running() -> bool:
    """Whether pyspark holds a gateway to a JVM (``SparkContext._gateway``): the next
    ``SparkSession.builder.getOrCreate()`` then launches none, and a new context gets its
    settings through the gateway."""
    check(PYSPARK, "SparkContext._gateway, to tell whether a session start launches a JVM")
    from pyspark.core.context import SparkContext

    return SparkContext._gateway is not None


def spark_jvm_process(spark: Any) -> Any:
    """The ``subprocess.Popen`` of the JVM that local session ``spark``'s gateway launched, or
    ``None`` (a Spark Connect session, or a gateway pyspark did not launch itself)."""
    check(PYSPARK, "SparkContext._gateway.proc, to tell whether the JVM still runs")
    from pyspark.core.context import SparkContext

    gateway = SparkContext._gateway
    if gateway is None or getattr(spark, "_sc", None) is None:
        return None
    return getattr(gateway, "proc", None)


def spark_context_stopped(spark: Any) -> bool:
    """Whether local session ``spark``'s JVM-side SparkContext has stopped (``_jsc.sc()``): a
    context Spark stopped by itself (a standalone application the cluster ended) fails every
    job, although its JVM still runs."""
    check(PYSPARK, "SparkContext._jsc, to tell whether the JVM-side context stopped")
    sc = getattr(spark, "_sc", None)
    jsc = getattr(sc, "_jsc", None)
    if jsc is None:
        return sc is not None
    return bool(jsc.sc().isStopped())


def spark_executor_count(spark: Any) -> int:
    """How many executors classic session ``spark``'s application has now, the driver not
    counted (``SparkContext.getExecutorMemoryStatus``, one entry per block manager, the
    driver's included, reached through ``_jsc``)."""
    check(PYSPARK, "SparkContext._jsc, to count an application's executors")
    jsc = spark._sc._jsc
    return max(0, int(jsc.sc().getExecutorMemoryStatus().size()) - 1)


def kill_launched_jvm() -> None:
    """SIGKILL the JVM pyspark's gateway launched, if it runs, without taking
    ``SparkContext._lock``: a thread starting a session holds that lock while it waits for the
    JVM, so this is how to make its call fail (and release the lock) from outside."""
    check(PYSPARK, "SparkContext._gateway.proc, to end a session start that hangs")
    from pyspark.core.context import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()


def forget_local_session() -> None:
    """Drop pyspark's handles of the process's local session and JVM (after the JVM died): the
    next ``SparkSession.builder.getOrCreate()`` starts a new JVM instead of reusing dead ones."""
    check(PYSPARK, "SparkContext/SparkSession class attributes, to start over after a JVM died")
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession

    with SparkContext._lock:
        gateway = SparkContext._gateway
        proc = getattr(gateway, "proc", None)
        if proc is not None:
            if proc.poll() is None:  # half started, or a stopped context's
                proc.kill()
            proc.wait()
            if proc.stdin is not None:  # the pipe the JVM watched to end with its parent
                proc.stdin.close()
        if gateway is not None:
            try:  # its connections to the dead JVM
                gateway.close()
            except Exception:
                log.warning("closing the dead Spark JVM's gateway failed", exc_info=True)
        SparkContext._gateway = None
        SparkContext._jvm = None
        SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None


# -- google-cloud-spanner ------------------------------------------------------------------------


def response_iterator(result_set: Any) -> AsyncIterator[Any]:
    """The partial result sets of an async ``StreamedResultSet`` (its ``_response_iterator``: the
    client's resuming stream), consumed directly instead of the client's row loop."""
    check(SPANNER, "StreamedResultSet._response_iterator")
    try:
        responses: AsyncIterator[Any] = result_set._response_iterator
    except AttributeError:
        raise _missing(SPANNER, "StreamedResultSet._response_iterator") from None
    return responses


def merge_function() -> Callable[[Any, Any, Any], Any]:
    """The client's merge of a chunked value with its continuation
    (``google.cloud.spanner_v1._async.streamed._merge_by_type``)."""
    check(SPANNER, "_async.streamed._merge_by_type")
    from google.cloud.spanner_v1._async import streamed

    merge = getattr(streamed, "_merge_by_type", None)
    if merge is None:
        raise _missing(SPANNER, "_async.streamed._merge_by_type")
    return cast(Callable[[Any, Any, Any], Any], merge)


async def cancel_stream(result_set: Any) -> None:
    """End the gRPC call behind an async result set whose consumer stopped early.

    Closing the client's response iterator alone leaves the call to the garbage collector (the
    wrappers around it form reference cycles), so the server keeps streaming for a while. The
    call object is the ``iterator`` local of the client's suspended ``_restart_on_unavailable``
    generator: cancel it, then close the generator. Nothing to do once the stream ended."""
    check(SPANNER, "the 'iterator' local of the suspended response generator's frame")
    agen: Any = getattr(result_set, "_response_iterator", None)
    frame = getattr(agen, "ag_frame", None)
    if frame is None:  # finished (normally or by an error)
        return
    call = frame.f_locals.get("iterator")
    if call is not None:  # None: the call was never made
        cancel = getattr(call, "cancel", None)
        if callable(cancel):
            cancel()
        else:
            log.warning("cannot find the gRPC call of a change-stream query to cancel it")
    await agen.aclose()


def database_transport(database: Any) -> Any:
    """The gRPC transport of a database's Spanner API (``Database._spanner_api``), or ``None``
    if it was never opened."""
    check(SPANNER, "Database._spanner_api")
    api = getattr(database, "_spanner_api", None)
    return None if api is None else api.transport


def admin_transports(client: Any) -> list[Any]:
    """The gRPC transports of a blocking client's admin APIs that were opened
    (``Client._instance_admin_api``, ``Client._database_admin_api``)."""
    check(SPANNER, "Client._instance_admin_api and Client._database_admin_api")
    apis = (getattr(client, a, None) for a in ("_instance_admin_api", "_database_admin_api"))
    return [api.transport for api in apis if api is not None]


# -- gRPC ----------------------------------------------------------------------------------------

GRPC_FORK_SUPPORT: Final = "GRPC_ENABLE_FORK_SUPPORT"


def disable_grpc_fork_support() -> None:
    """Turn gRPC's fork handlers off for this process unless the user set
    ``GRPC_ENABLE_FORK_SUPPORT``. Call it before a Spanner client (gRPC) is first imported.

    With them on, a fork while the Spanner client's threads run breaks the child: Spark's JVM
    launcher dies at once ("Java gateway process exited before sending its port number") when the
    Spanner and Spark paths share one process. gRPC reads the variable when it is imported."""
    if GRPC_FORK_SUPPORT not in os.environ and "grpc" in sys.modules:
        log.info(
            "gRPC was imported before its fork support could be turned off; set %s=false in "
            "the environment if a fork (e.g. Spark's JVM launcher) fails",
            GRPC_FORK_SUPPORT,
        )
    os.environ.setdefault(GRPC_FORK_SUPPORT, "false")
