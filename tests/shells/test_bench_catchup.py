"""bench/catchup.py measures a run's own peak memory, not what Linux carries over from the
harness that spawned it (``wait4``'s ``ru_maxrss`` inherits the spawner's peak across exec)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.catchup import _high_water_kb


def test_a_child_s_own_peak_is_not_its_spawner_s() -> None:
    ballast = bytearray(200 * 1024 * 1024)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1  # the harness now holds ~200 MB
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    own = 0
    while child.poll() is None:
        own = max(own, _high_water_kb(child.pid))
        time.sleep(0.05)
    del ballast
    assert 0 < own < 100 * 1024  # the child's own: a bare interpreter
    # control: what wait4 would have said for the same kind of child
    again = subprocess.Popen([sys.executable, "-c", "pass"])
    _, status, usage = os.wait4(again.pid, 0)
    again.returncode = os.waitstatus_to_exitcode(status)
    assert usage.ru_maxrss > 150 * 1024  # the harness's peak, carried across exec


def test_a_process_that_is_gone_has_no_peak() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _high_water_kb(child.pid) == 0
