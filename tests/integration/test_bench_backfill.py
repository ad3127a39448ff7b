"""``python -m bench backfill`` with a short load: the CLI, given ``--start-at`` / ``--end-at``
inside a load committed to the Cloud Spanner emulator with partition churn, exits 0 by itself and
its typed output holds exactly the window's changes (skipped, with the reason printed, where the
emulator binary is absent). The comparison it rests on is checked first, with and without
faults in the output, and so is the reader of the output it shares with ``bench chaos``: the same
changes written by the file sink in either layout read back the same."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Literal

import pytest

from bench import backfill
from bench.chaos import read_output
from bench.output import read_changes, typed_tables
from protocol.records import ColumnType, DataChange, Mod
from runtime.files.sink import FileSink
from runtime.ports import SinkBatch
from tests.parts import require_emulator

# (commit_ts, table, mod type, Id): a load of five changes; the window is [20, 40]
LOAD = Counter({(10, "T", "INSERT", 1): 1, (20, "T", "INSERT", 2): 1, (30, "U", "UPDATE", 3): 1})
LOAD.update({(40, "T", "DELETE", 2): 1, (50, "U", "INSERT", 4): 1})
WINDOW = Counter({k: n for k, n in LOAD.items() if 20 <= k[0] <= 40})


def test_the_comparison_of_a_window_exactly_delivered_finds_nothing() -> None:
    result = backfill.compare(LOAD, WINDOW, 20, 40)
    assert (result["committed"], result["delivered"]) == (3, 3)
    assert (result["before_window"], result["after_window"]) == (1, 1)
    assert result["lost"] == result["extra"] == result["outside_window"] == 0
    assert (result["at_start"], result["at_end"]) == (1, 1)  # both bounds inclusive
    assert backfill.passed({**result, "exited_by_itself": True})
    assert not backfill.passed({**result, "exited_by_itself": False})


@pytest.mark.parametrize(
    ("output", "lost", "extra", "outside"),
    [
        (WINDOW - Counter({(40, "T", "DELETE", 2): 1}), 1, 0, 0),  # the end bound left out
        (WINDOW + Counter({(30, "U", "UPDATE", 3): 1}), 0, 1, 0),  # a duplicate row
        (WINDOW + Counter({(10, "T", "INSERT", 1): 1}), 0, 1, 1),  # a change before the window
        (WINDOW + Counter({(50, "U", "INSERT", 4): 1}), 0, 1, 1),  # a change after it
    ],
)
def test_the_comparison_catches_a_lost_a_duplicate_and_an_outside_row(
    output: Counter[backfill.KEY], lost: int, extra: int, outside: int
) -> None:
    result = backfill.compare(LOAD, output, 20, 40)
    assert (result["lost"], result["extra"], result["outside_window"]) == (lost, extra, outside)
    assert not backfill.passed({**result, "exited_by_itself": True})


ID = ColumnType("Id", '{"code":"INT64"}', True, 1)
VALUE = ColumnType("Value", '{"code":"INT64"}', False, 2)


def change(ts: int, table: str, mod_type: str, keys: tuple[int, ...]) -> DataChange:
    mods = tuple(Mod(f'{{"Id":"{k}"}}', f'{{"Value":"{ts}"}}', "{}") for k in keys)
    return DataChange(ts, "00000001", f"tx{ts}", True, table, (ID, VALUE), mods, mod_type)  # type: ignore[arg-type]


RECORDS = (
    change(10, "A", "INSERT", (1, 2)),
    change(11, "B", "INSERT", (3,)),
    change(12, "A", "UPDATE", (2,)),
)


async def write(directory: Path, layout: Literal["typed", "generic"]) -> Path:
    data = directory / layout / "data"
    async with FileSink(data, max_age_s=0.01, layout=layout) as sink:
        await (await sink.put(SinkBatch("p0", RECORDS[:2], 11)))
        await (await sink.put(SinkBatch("p1", RECORDS[2:], 12)))
    return data


@pytest.mark.asyncio
async def test_the_output_reads_the_same_in_either_layout(tmp_path: Path) -> None:
    typed, generic = await write(tmp_path, "typed"), await write(tmp_path, "generic")
    expected = {(10, "A", "INSERT", 1), (10, "A", "INSERT", 2), (11, "B", "INSERT", 3)}
    expected.add((12, "A", "UPDATE", 2))
    for data in (typed, generic):
        changes = list(read_changes(data))
        assert {(c.commit_ts, c.table, c.mod_type, c.key) for c in changes} == expected
        assert len(changes) == 4
        assert {c.partition_token for c in changes} == {"p0", "p1"}
        delivered, rows, dropped = read_output(data.parent)  # bench chaos reads it so too
        assert (set(delivered), rows, dropped) == (expected, 4, 0)
    assert (typed_tables(typed), typed_tables(generic)) == (2, 0)


def test_the_rfc3339_bounds_keep_every_microsecond() -> None:
    assert backfill.rfc3339(1_700_000_000_000_001) == "2023-11-14T22:13:20.000001Z"
    assert backfill.choose_window([8, 1, 2, 3, 4, 5, 6, 7]) == (3, 7)


@pytest.mark.slow
@pytest.mark.spanner
@pytest.mark.kafka
@pytest.mark.parametrize("kill", [False, True], ids=["one-run", "killed-mid-read-and-restarted"])
def test_a_bounded_backfill_exits_by_itself_with_exactly_its_window(
    capsys: pytest.CaptureFixture[str], kill: bool
) -> None:
    require_emulator()
    options = ["--load-s", "10", "--rate", "15", "--churn-s", "2", "--timeout-s", "180"]
    code = backfill.main([*options, *(["--kill-mid-read"] if kill else [])])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["scenario"] == "backfill", out
    assert result["exited_by_itself"] is True, out
    assert result["committed"] > 0, out
    assert result["delivered"] == result["committed"], out
    assert result["lost"] == result["extra"] == result["outside_window"] == 0, out
    assert result["typed_tables"] >= 1, out
    assert ("killed_and_restarted_at_s" in out) == kill, out
    assert code == 0, out
