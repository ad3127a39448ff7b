"""Where a test finds that a real part it needs is missing (the Cloud Spanner emulator, Java,
stunnel, moto's S3 server, a certificate tool), and what then happens: the test skips with the reason, or, when
``SHOAL_REQUIRE_PARTS=1`` (``.ci/run`` sets it), fails with it, so that CI cannot pass with
real-part tests skipped. Every such decision in the tests goes through :func:`require_part`."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

from runtime.spanner.emulator import EmulatorUnavailable, find_emulator
from runtime.spark.session import java_executable

REQUIRE_ENV = "SHOAL_REQUIRE_PARTS"


def parts_required(environ: dict[str, str] | None = None) -> bool:
    """Whether a missing part fails the test (``SHOAL_REQUIRE_PARTS=1``) or skips it (unset,
    empty or ``0``); any other value is refused, naming the variable."""
    value = (os.environ if environ is None else environ).get(REQUIRE_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise pytest.UsageError(f"{REQUIRE_ENV} must be 1 (missing parts fail) or 0, not {value!r}")


def require_part(name: str, reason: str) -> NoReturn:
    """``name`` is missing for the reason given: skip the test, or fail it when parts are
    required."""
    if parts_required():
        pytest.fail(f"{name} is missing and {REQUIRE_ENV}=1 requires it: {reason}", pytrace=False)
    pytest.skip(f"{name} is missing: {reason}")


def require_java(what: str = "local Spark") -> str:
    """The ``java`` Spark runs, or :func:`require_part` saying ``what`` needs it."""
    found = java_executable()
    if found is None:
        require_part("Java", f"{what} needs Java 17+ (JAVA_HOME or java on PATH)")
    return found


def require_emulator() -> str:
    """The Cloud Spanner emulator's binary, or :func:`require_part` with why it was not found."""
    try:
        return find_emulator()
    except EmulatorUnavailable as exc:
        require_part("the Cloud Spanner emulator", str(exc))
