"""A bad ``--output-dir`` (``run.output_dir``) is found at start, before the embedded broker or
Spark starts, and named as the option, with exit code 2: a file, a path below a file, a ``data``
entry that is a file, a directory this process cannot write in. The runs go through ``main`` on
the real file system; none of them starts anything (no ``broker.log`` appears)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.runtime import main


def _a_file(tmp: Path) -> Path:
    (tmp / "out").write_text("not a directory\n")
    return tmp / "out"


def _below_a_file(tmp: Path) -> Path:
    (tmp / "plain").write_text("x\n")
    return tmp / "plain" / "out"


def _data_is_a_file(tmp: Path) -> Path:
    (tmp / "out").mkdir()
    (tmp / "out" / "data").write_text("x\n")
    return tmp / "out"


def _not_writable(tmp: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes in a directory whatever its mode (see the read-only case)")
    out = tmp / "out"
    out.mkdir()
    out.chmod(0o500)
    return out


def _read_only_system_dir(tmp: Path) -> Path:
    """A directory nobody may create files in, root included (Linux's sysfs)."""
    path = Path("/sys/kernel")
    if not path.is_dir():
        pytest.skip("no /sys/kernel on this system")
    try:
        (path / ".shoal-probe").write_bytes(b"")
    except OSError:
        return path
    (path / ".shoal-probe").unlink()
    pytest.skip("/sys/kernel takes files on this system")


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (_a_file, "is a file, not a directory"),
        (_below_a_file, "cannot create it"),
        (_data_is_a_file, "data' is a file"),
        (_not_writable, "cannot write in"),
        (_read_only_system_dir, "cannot write in"),
    ],
    ids=["file", "below-a-file", "data-is-a-file", "not-writable", "read-only"],
)
def test_bad_output_dir_exits_2_at_start_naming_the_option(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], Path],
    needle: str,
) -> None:
    out = make(tmp_path)
    try:
        code = main(["--sink", "files", "--output-dir", str(out), "--duration", "1"])
    finally:
        if out.is_dir() and str(out).startswith(str(tmp_path)):
            out.chmod(0o700)
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"shoal: error: output_dir {str(out)!r} (--output-dir)"), lines
    assert needle in lines[0]
    assert "embedded broker" not in captured.out  # found before anything started
    assert not list(tmp_path.rglob("broker.log"))


def test_a_good_output_dir_is_created_and_left_clean(tmp_path: Path) -> None:
    """Control: the check creates a missing output directory and leaves no probe file."""
    from actors.cli.run import check_output_dir

    out = tmp_path / "a" / "b"
    check_output_dir(out)
    assert out.is_dir()
    assert list(out.iterdir()) == []
