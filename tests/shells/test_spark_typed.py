"""Where the Spark bridge writes its typed default output (runtime/spark/typed_output.py) and
where it refuses to. What it writes, through one Spark job per micro-batch, is checked with
real Spark in tests/integration/test_spark_typed_writes.py."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.spark import SparkConfig
from runtime.spark.bridge import _layout


def test_the_layout_is_typed_where_it_can_be_written() -> None:
    assert _layout(SparkConfig(), has_foreach=False) == "typed"
    assert _layout(SparkConfig(path="streaming"), has_foreach=False) == "generic"
    assert _layout(SparkConfig(output_dir="s3a://b/o"), has_foreach=False) == "generic"
    assert _layout(SparkConfig(output_layout="generic"), has_foreach=False) == "generic"
    with pytest.raises(ValueError, match="typed"):
        _layout(SparkConfig(path="streaming", output_layout="typed"), has_foreach=False)
    kw: dict[str, Any] = {"output_dir": "hdfs://nn/out", "output_layout": "typed"}
    with pytest.raises(ValueError, match="typed"):
        _layout(SparkConfig(**kw), has_foreach=False)
