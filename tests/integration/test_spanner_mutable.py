"""Against the real Cloud Spanner emulator (skipped, with the reason, where its binary is
absent): a MUTABLE_KEY_RANGE change stream. The emulator here (528.0.0) refuses the option
("Option: partition_mode is unknown"): the test then skips, saying so; the mode's reading is
tested in tests/core/test_mutable_task.py, tests/shells/test_mutable_reader.py (result sets of
the documented protobuf types), tests/sim/test_nodes_mutable.py and the fault simulator
(``partition_mode="mutable"``). Where an emulator accepts it, the stream's options say the
mode, the source follows it, and the root query answers a partition start."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from protocol.mutable import PartitionStart
from runtime.spanner.emulator import sync_client
from runtime.spanner.reader import SpannerSource
from tests.fixtures.spanner import _start_emulator

pytestmark = [pytest.mark.spanner]

STREAM = "MutableStream"


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_mutable_key_range_stream_where_the_emulator_takes_the_option() -> None:
    emulator = _start_emulator()
    try:
        with sync_client(emulator.config) as client:
            db: Any = client.instance(emulator.config.instance).database(emulator.config.database)
            ddl = (
                f"CREATE CHANGE STREAM {STREAM} FOR Singers "
                "OPTIONS (partition_mode = 'MUTABLE_KEY_RANGE')"
            )
            try:
                await asyncio.to_thread(lambda: db.update_ddl([ddl]).result(60))
            except Exception as exc:
                if "partition_mode" not in str(exc):
                    raise
                pytest.skip(
                    "this emulator refuses a MUTABLE_KEY_RANGE change stream "
                    f"({str(exc).strip().splitlines()[0]}); the mode is tested in the cores, "
                    "on protobuf result sets and in the simulators"
                )
        config = msgspec.structs.replace(emulator.config, change_stream=STREAM)
        async with await SpannerSource.connect(config) as source:
            await source.detect_dialect(config.database)
            options = await source.stream_options()
            assert options is not None
            assert options.mutable_key_range
            assert source.mutable
            start = int(time.time() * 1e6) - 1
            records = [r async for batch in source.query(None, start, None) for r in batch]
        assert any(isinstance(r, PartitionStart) and r.tokens for r in records)
    finally:
        emulator.stop()
