"""No Spark setting on a command line: the Spark bridge starts local Spark the way the command
line does, with a secret-looking setting (an object store's secret key) and an ordinary one in
its ``conf``, and while the session runs every process's command line is read, as any user of
the machine can (``ps -ww -eo args`` and ``/proc/<pid>/cmdline``): neither value is there, not on
the JVM's, nor on its children's (the Python workers of a job), nor anywhere else; and both
reached Spark, the secret with the characters a properties file must escape intact.

The controls: the same scan finds a value that is on a command line (a process started with it
as an argument), and on the JVM's own command line it finds what the settings file made of
``spark.driver.memory`` (``-Xmx``, which only the launcher reading that file can set) next to
``--properties-file``: the scan reads the real JVM's arguments, and the settings went by file.
One Spark start for the module (about 8-20 s here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.procs import descendants
from runtime import compat
from runtime.spark import SparkBridge, SparkConfig
from tests.helpers import command_lines, ps_lines, wait_until
from tests.parts import require_java

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _java() -> None:
    require_java()


SECRET_KEY = "spark.hadoop.fs.s3a.secret.key"
# '=', ':', '#', a backslash, spaces and a non-ASCII letter: a properties file must escape them
SECRET = "s3a=Secret:#\\ with spaces é-ARGV-SECRET-k7Q"
PLAIN_KEY = "spark.shoal.test.marker"
PLAIN = "plain-marker-ARGV-9xZ"
DRIVER_MEMORY = "777m"


def _holding(value: str) -> list[str]:
    """The command lines (``/proc`` and ``ps``) that hold ``value``."""
    found = [f"/proc {pid}: {line}" for pid, line in command_lines().items() if value in line]
    return found + [f"ps: {line}" for line in ps_lines() if value in line]


def _environment(pid: int) -> str:
    """The environment ``pid`` started with (readable by its user only)."""
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def _settings_files(local_dir: str) -> list[Path]:
    """The properties files left in the session's directory (which must exist)."""
    assert Path(local_dir).is_dir(), local_dir
    return list(Path(local_dir).glob("*.properties"))


def test_the_scan_sees_a_value_on_a_command_line() -> None:
    """The control: a process started with the value as an argument is found by both views."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", SECRET], stdin=subprocess.PIPE
    )
    try:
        wait_until(lambda: len(_holding(SECRET)) >= 2, 30, "the decoy's command line")
        assert any(line.startswith(f"/proc {proc.pid}:") for line in _holding(SECRET))
        assert any(f"{proc.pid} " in line for line in _holding(SECRET) if line.startswith("ps:"))
    finally:
        proc.communicate(b"")
    assert not _holding(SECRET)


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_spark_settings_reach_spark_and_no_command_line(tmp_path: Path) -> None:
    if compat.spark_jvm_running():
        # a JVM an earlier test module launched: drop it, so that this start launches one
        compat.forget_local_session()
    config = SparkConfig(
        output_dir=str(tmp_path / "out"),
        conf={SECRET_KEY: SECRET, PLAIN_KEY: PLAIN, "spark.driver.memory": DRIVER_MEMORY},
    )
    async with SparkBridge(config) as bridge:
        spark: Any = bridge.spark
        jvm = compat.spark_jvm_process(spark)
        assert jvm is not None, "the bridge did not launch a JVM of its own"
        # a Python job: the JVM starts Python workers, its children
        assert spark.sparkContext.parallelize(range(8), 2).map(lambda x: x + 1).sum() == 36
        children = descendants(jvm.pid)
        lines = command_lines()
        scanned = {"ps": ps_lines(), "/proc": list(lines.values())}
        jvm_line = lines[jvm.pid]
        child_lines = [lines[pid] for pid in children if pid in lines]
        environment = _environment(jvm.pid)
        # the settings reached Spark, unchanged
        assert spark.conf.get(SECRET_KEY) == SECRET
        assert spark.sparkContext.getConf().get(SECRET_KEY) == SECRET
        assert spark.conf.get(PLAIN_KEY) == PLAIN
        # the settings file was deleted once Spark had started (the bridge's directory stays)
        assert _settings_files(spark.conf.get("spark.local.dir")) == []
    # the controls: the scan read the JVM's own arguments, which the settings shaped
    assert "org.apache.spark.deploy.SparkSubmit" in jvm_line
    assert f"-Xmx{DRIVER_MEMORY}" in jvm_line, jvm_line
    assert any("pyspark" in line for line in child_lines), child_lines
    # no value of the settings on any command line: the JVM's, its children's, anyone's
    for value in (SECRET, PLAIN):
        assert value not in jvm_line
        assert not [line for line in child_lines if value in line]
        for view, seen in scanned.items():
            assert not [line for line in seen if value in line], f"{view} shows {value!r}"
    assert SECRET not in environment
    # they went by file
    assert "--properties-file" in jvm_line
