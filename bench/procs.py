"""Finding the processes a shoal run started (Linux ``/proc``), to inject faults into them: the
local Spark JVM, the embedded broker, the Spanner emulator."""

from __future__ import annotations

from pathlib import Path

__all__ = ["children", "cmdline", "descendants", "spark_jvm_pids"]


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
