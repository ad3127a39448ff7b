"""Finding the processes a shoal run started (Linux ``/proc``), to inject faults into them: the
local Spark JVM, the embedded broker, the Spanner emulator."""

from __future__ import annotations

from pathlib import Path

__all__ = ["children", "cmdline", "descendants", "spark_jvm_pids", "start_time", "tree"]


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (arguments joined by spaces), or "" once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def spark_jvm_pids(parent: int) -> list[int]:
    """The local Spark JVMs (``SparkSubmit``) a process started: its direct children."""
    return [p for p in children(parent) if "org.apache.spark.deploy.SparkSubmit" in cmdline(p)]


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, ...), or None once gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process even
    after the pid is reused; None once it is gone (or a zombie)."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def tree(pid: int) -> dict[int, int]:
    """Every process below ``pid`` with its :func:`start_time`, from one pass over ``/proc``."""
    parent: dict[int, int] = {}
    started: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(entry.name)
        if fields is None or len(fields) < 20 or fields[0] == "Z":
            continue
        parent[int(entry.name)] = int(fields[1])
        started[int(entry.name)] = int(fields[19])
    below: dict[int, int] = {}
    for child in parent:
        p = parent[child]
        while p > 1 and p != pid:
            p = parent.get(p, 0)
        if p == pid and child != pid:
            below[child] = started[child]
    return below
