"""``SHOAL_REQUIRE_PARTS``: a missing real part skips a test, or fails it when CI requires every
part (``.ci/run`` sets the variable before it runs ``./scripts/test``)."""

from __future__ import annotations

import pytest

from runtime.spanner.emulator import EMULATOR_ENV
from tests.helpers import REPO
from tests.parts import REQUIRE_ENV, parts_required, require_emulator, require_java, require_part


@pytest.mark.parametrize("value", ["", "0"])
def test_a_missing_part_skips_with_its_reason_by_default(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(REQUIRE_ENV, value)
    with pytest.raises(pytest.skip.Exception, match="stunnel is missing: no proxy"):
        require_part("stunnel", "no proxy")


def test_a_missing_part_fails_when_parts_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"stunnel is missing and {REQUIRE_ENV}=1"):
        require_part("stunnel", "no proxy")


def test_a_missing_emulator_and_java_go_through_the_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    monkeypatch.setenv(EMULATOR_ENV, "/nonexistent/emulator_main")
    with pytest.raises(pytest.fail.Exception, match="Cloud Spanner emulator is missing"):
        require_emulator()
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.fail.Exception, match="Java is missing"):
        require_java()
    monkeypatch.setenv(REQUIRE_ENV, "0")
    with pytest.raises(pytest.skip.Exception, match="Java is missing"):
        require_java()


def test_a_bad_value_is_refused_naming_the_variable() -> None:
    assert parts_required({REQUIRE_ENV: "1"})
    with pytest.raises(pytest.UsageError, match=f"{REQUIRE_ENV} must be 1"):
        parts_required({REQUIRE_ENV: "yes"})


def test_ci_requires_every_part_and_runs_the_readme_command() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line and not line.startswith("#")]
    assert commands[-2:] == [f"export {REQUIRE_ENV}=1", "exec ./scripts/test"], ci
    assert "    ./scripts/test\n" in (REPO / "README.md").read_text()
