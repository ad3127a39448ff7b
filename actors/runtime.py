"""``python -m actors.runtime``: run shoal, or look at a running connector.

Commands (``run`` is the default)::

    python -m actors.runtime [run] [options]    run tasks until stopped, or a bounded run
    python -m actors.runtime status [options]   replay the sync topic, print tasks/partitions
    python -m actors.runtime dlq list|replay    the dead-letter queue of --sink kafka / spark
    python -m actors.runtime quarantine list|release TOKEN   partitions parked by the
                                                quarantine rule; release one (read it again)
    python -m actors.runtime config [--reference]   the effective options / the docs table
    python -m actors.runtime output show|add-storage-topic N|switch-produce|shards N|tail
                                                scale the Kafka output (--sink kafka) live

With no option at all it runs the whole pipeline on this machine: the embedded Kafka-compatible
broker, the simulated change stream, three tasks, and the sink, with a live progress display.

Exit codes: 0 done (a bounded run caught up and drained, or a stop signal drained cleanly);
1 a component failed, a bounded run did not catch up, or the drain timed out; 2 a bad option or
file; 130/143 a second SIGINT/SIGTERM cut the drain short.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TextIO

import msgspec

from actors.cli import config as options
from actors.cli.config import ConfigError, ShoalConfig
from actors.embed import CallbackSink, open_task

__all__ = ["CallbackSink", "main", "open_task", "run"]

PROG = "python -m actors.runtime"
COMMANDS = ("run", "status", "dlq", "quarantine", "config", "output")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(command: str = "run") -> argparse.ArgumentParser:
    descriptions = {
        "run": "Run shoal tasks. With no option: embedded broker, simulated stream, "
        "3 tasks, local Spark writing parquet, live progress.",
        "status": "Replay the connector's sync topic and print its tasks, partitions, "
        "watermarks, lag, epoch and leader.",
        "dlq": "List or replay the dead-letter queue of the sink --sink names: the Kafka output "
        "sink's (--sink kafka) or the Spark bridge's (--sink spark --spark-dead-letter).",
        "quarantine": "List the partitions the quarantine rule parked (their reader kept "
        "failing: the error, the record, the watermark), or release one: its owner reads it "
        "again from exactly its watermark. See docs/operations.md, 'Quarantined partitions'.",
        "config": "Print the effective configuration (secrets hidden), or the reference.",
        "output": "Scale the keyed Kafka output (--sink kafka) while shoal runs: show its "
        "composite topic; add-storage-topic N (a new storage topic of N partitions, K by the "
        "routing rule, a warning when K falls to 1); switch-produce (move the produce pointer to "
        "it: running processes switch together at a barrier, the old storage topic is sealed); "
        "shards N (the RQ/DLQ shard count: running processes move their RQ/DLQ writes together "
        "at a barrier, new RQ/DLQ storage topics when needed, the records held in the old ones "
        "fed to them; run it again if it was interrupted); tail (the records in per-key order "
        "across storage "
        "topics, one JSON line each). See docs/operations.md, 'Scaling the Kafka output'.",
    }
    prog = PROG if command == "run" else f"{PROG} {command}"
    usage = {
        "run": f"{PROG} [run] [options]",
        "status": f"{prog} [--json | --wide] [options]",
        "dlq": f"{prog} {{list,replay}} [--id ID ...] [options]",
        "quarantine": f"{prog} {{list,release TOKEN ...}} [--json] [options]",
        "config": f"{prog} [--reference] [options]",
        "output": f"{prog} {{show,add-storage-topic N,switch-produce,shards N,tail}} [options]",
    }[command]
    parser = _Parser(
        prog=prog,
        usage=usage,
        description=descriptions[command],
        epilog="Precedence: flags > SHOAL_* environment variables > --config TOML file > "
        "defaults. Commands: run (default), status, dlq, quarantine, config, output. "
        "Reference: docs/configuration.md.",
    )
    if command == "dlq":
        parser.add_argument("action", choices=("list", "replay"))
        parser.add_argument(
            "--id", dest="ids", action="append", default=[], help="replay only this record id"
        )
        parser.add_argument(
            "--via-leader",
            action="store_true",
            help="replay: hand the records to the running shoal processes (their leader "
            "delivers them) instead of delivering them from here (which needs them stopped)",
        )
    if command == "quarantine":
        parser.add_argument("action", choices=("list", "release"))
        parser.add_argument(
            "tokens", nargs="*", default=[], help="release: the partition tokens to release"
        )
        parser.add_argument("--json", action="store_true", help="list: print JSON")
    if command == "status":
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.add_argument(
            "--wide",
            action="store_true",
            help="show whole partition tokens (the table shortens long ones to their first "
            "characters and a hash)",
        )
    if command == "output":
        from actors.cli.output import ACTIONS

        parser.add_argument("action", choices=ACTIONS)
        parser.add_argument(
            "count",
            nargs="?",
            type=int,
            default=None,
            help="add-storage-topic: its partition count; shards: the RQ/DLQ shard count",
        )
        parser.add_argument("--json", action="store_true", help="show: print JSON")
        parser.add_argument(
            "--wait",
            type=float,
            default=120.0,
            help="switch-produce: give up after this many seconds [default: 120]",
        )
        parser.add_argument(
            "--idle-exit",
            type=float,
            default=None,
            help="tail: stop after this many seconds without a record (default: follow)",
        )
    if command == "config":
        parser.add_argument("--reference", action="store_true", help="print docs/configuration.md")
    options.add_arguments(parser)
    return parser


def _split(argv: Sequence[str]) -> tuple[str, list[str]]:
    if argv and argv[0] in COMMANDS:
        return argv[0], list(argv[1:])
    return "run", list(argv)


def _fail(out: TextIO, message: str, code: int) -> int:
    out.write(f"shoal: error: {message}\n")
    out.flush()
    return code


def _describe(error: BaseException) -> str:
    """A failure for the one-line message: a port's unrecoverable failure (and a component's
    ``RunFailed``) names the part and the cause itself; anything else gets its type."""
    from actors.cli.run import RunFailed
    from runtime.ports import Unrecoverable

    if isinstance(error, Unrecoverable | RunFailed):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


def main(argv: Sequence[str] | None = None) -> int:
    command, rest = _split(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command)
    args = parser.parse_args(rest)
    try:
        config = options.load(args)
    except ConfigError as exc:
        return _fail(sys.stderr, str(exc), 2)

    from runtime import logs

    logs.configure(
        config.run.log_level,
        json_lines=config.run.log_json,
        secrets=options.secret_values(config),
    )
    if command == "config":
        if args.reference:
            sys.stdout.write(options.reference_markdown())
        else:
            from actors.cli.admin import change_stream_options

            shown = options.redacted(config)
            if config.run.source == "spanner":
                shown["change_stream_options"] = _run_loop(change_stream_options(config))
            sys.stdout.write(msgspec.json.format(msgspec.json.encode(shown)).decode() + "\n")
        return 0
    secrets = options.secret_values(config)
    try:
        return _run_loop(_main_async(command, args, config))
    except ConfigError as exc:
        return _fail(sys.stderr, logs.mask(str(exc), secrets), 2)


def _run_loop(coro: object) -> int:
    import uvloop

    result: int = uvloop.run(coro)  # type: ignore[arg-type]
    return result


async def _main_async(command: str, args: argparse.Namespace, config: ShoalConfig) -> int:
    from actors.cli import admin

    try:
        if command == "status":
            return await admin.status(config, sys.stdout, as_json=args.json, wide=args.wide)
        if command == "output":
            from actors.cli.output import output

            return await output(
                config,
                args.action,
                args.count,
                sys.stdout,
                as_json=args.json,
                wait_s=args.wait,
                idle_exit_s=args.idle_exit,
            )
        if command == "quarantine":
            return await admin.quarantine(
                config, args.action, args.tokens, sys.stdout, as_json=args.json
            )
        if command == "dlq":
            return await admin.dlq(
                config, args.action, args.ids, sys.stdout, via_leader=args.via_leader
            )
        return await run(config)
    except ConfigError:
        raise
    except Exception as exc:
        messages = "; ".join(dict.fromkeys(_describe(e) for e in _leaves(exc)))
        if isinstance(exc, BaseExceptionGroup) and all(
            isinstance(e, ConfigError) for e in _leaves(exc)
        ):
            # a bad option found while running (several tasks may find the same): its message
            # alone, once, names the option
            raise ConfigError("; ".join(dict.fromkeys(str(e) for e in _leaves(exc)))) from exc
        import logging

        logging.getLogger("shoal.runtime").debug("run failed", exc_info=exc)
        from runtime import logs

        return _fail(sys.stderr, logs.mask(messages, options.secret_values(config)), 1)


async def run(config: ShoalConfig) -> int:
    """The ``run`` command: a :class:`~actors.cli.run.Pipeline` with signal handling."""
    from actors.cli.progress import format_summary
    from actors.cli.run import Pipeline

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen = 0
    pipeline = Pipeline(config, stop=stop, out=sys.stdout, live=sys.stdout.isatty())

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        name = signal.Signals(signum).name
        if signals_seen == 1:
            sys.stderr.write(
                f"\nshoal: {name}: draining (at most {config.run.drain_timeout:.0f}s); "
                "send it again to exit at once\n"
            )
            sys.stderr.flush()
            stop.set()
        else:
            sys.stderr.write(f"\nshoal: second {name}: exiting now, without draining\n")
            sys.stderr.flush()
            pipeline.abort()
            os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        summary = await pipeline.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    sys.stdout.write(format_summary(summary) + "\n")
    sys.stdout.flush()
    if config.run.summary_json:
        path = Path(config.run.summary_json)
        await asyncio.to_thread(path.write_bytes, msgspec.json.encode(summary))
    ok = summary.drained and summary.caught_up is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
