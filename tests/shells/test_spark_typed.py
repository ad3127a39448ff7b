"""Where the Spark bridge writes its typed default output (runtime/spark/typed_output.py) and
where it refuses to. What it writes, through one Spark job per micro-batch, is checked with
real Spark in tests/integration/test_spark_typed_writes.py."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.spark import SparkBridge, SparkConfig
from runtime.spark.bridge import _layout
from runtime.spark.dead_letter import DeadLetterConfig


def _dead_letter() -> DeadLetterConfig:
    from runtime.kafka.config import KafkaConfig

    return DeadLetterConfig(kafka=KafkaConfig(bootstrap_servers="127.0.0.1:1"), name="t")


def test_the_layout_is_typed_where_it_can_be_written() -> None:
    assert _layout(SparkConfig(), has_foreach=False) == "typed"
    assert _layout(SparkConfig(path="streaming"), has_foreach=False) == "typed"
    assert _layout(SparkConfig(output_dir="s3a://b/o"), has_foreach=False) == "generic"
    assert _layout(SparkConfig(output_layout="generic"), has_foreach=False) == "generic"
    with pytest.raises(ValueError, match="typed"):
        _layout(SparkConfig(dead_letter=_dead_letter(), output_layout="typed"), has_foreach=False)
    kw: dict[str, Any] = {"output_dir": "hdfs://nn/out", "output_layout": "typed"}
    with pytest.raises(ValueError, match="typed"):
        _layout(SparkConfig(**kw), has_foreach=False)


@pytest.mark.parametrize("where", ["s3://b/o", "gs://b/o", "file:///tmp/o", "relative/o"])
def test_the_typed_layout_goes_to_paths_and_pyarrow_stores(where: str) -> None:
    assert _layout(SparkConfig(output_dir=where), has_foreach=False) == "typed"


def test_delta_tables_are_the_committed_typed_output() -> None:
    """``table_format='delta'`` is written only where the bridge commits the typed output; on
    an object store it gets a committer over the store (no Spark is started here)."""
    refused: list[dict[str, Any]] = [
        {"output_layout": "generic"},
        {"atomic_commit": False},
        {"path": "streaming", "output_layout": "generic"},
        {"output_dir": "s3a://b/o"},
    ]
    for kw in refused:
        with pytest.raises(ValueError, match="delta"):
            SparkBridge(SparkConfig(table_format="delta", **kw))
    with pytest.raises(ValueError, match="delta"):
        SparkBridge(SparkConfig(table_format="delta"), foreach_batch=lambda df, batch_id: None)
    streaming = SparkBridge(SparkConfig(table_format="delta", path="streaming"))
    assert streaming.layout == "typed"
    assert streaming.committer is not None
    with pytest.raises(ValueError, match="spool_dir"):
        SparkBridge(SparkConfig(path="streaming", output_dir="s3://b/o"))
    bridge = SparkBridge(SparkConfig(table_format="delta", output_dir="s3://b/o"))
    assert bridge.layout == "typed"
    assert bridge.committer is not None
    assert bridge.committer.store.uri_for() == "s3://b/o"
