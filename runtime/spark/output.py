"""Reading the default parquet output back (tests, the CLI's counts, the bench)."""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from runtime.spark.rows import KEY_COLUMNS

__all__ = ["read_output", "streaming_sink_files", "write_default", "write_staged"]


def read_output(
    spark_or_path: Any, path: str | os.PathLike[str] | None = None, *, dedupe: bool = True
) -> Any:
    """The rows of the default output.

    ``read_output("dir")`` reads it with pyarrow and returns a ``pyarrow.Table`` (no Spark
    needed); ``read_output(spark, "dir")`` returns a Spark ``DataFrame``. Both carry the
    partition columns ``table`` and ``batch``, and skip every name starting with ``_`` or
    ``.`` (staged batches, Spark's ``_temporary``, the sink's ``_shoal`` records).

    ``dedupe=False`` is the honest raw read: exactly the committed rows on disk. With atomic
    commits (docs/design.md#exactly-once-output) it holds each change once. The streaming
    path's output is committed by Spark's file sink, whose log (``_spark_metadata``) names the
    files of committed micro-batches: both reads take only those (as Spark's own reader does),
    so files a micro-batch left when its JVM died are not read. With ``dedupe``
    (the default) a row whose key (commit timestamp, server transaction id, record sequence,
    mod index) was already read is dropped as well, for outputs written without atomic commits
    (``foreach_batch`` into this layout, ``atomic_commit=False``).

    Of a **typed** output (``output_layout="typed"``) the pyarrow read returns every table's
    rows as their metadata and row key columns under the generic names (``table``,
    ``commit_ts`` as int microseconds, ``server_transaction_id``, ``record_sequence``,
    ``mod_index``, ``partition_token``, ``mod_type``, ``batch``) without the tables' own
    columns: read one table with ``runtime.files.typed.read_table``, or with Spark
    (docs/reading-output.md).
    """
    if isinstance(spark_or_path, str | os.PathLike):
        from runtime.files.typed import is_typed_layout

        if is_typed_layout(spark_or_path):
            return _read_typed(Path(spark_or_path), dedupe)
        return _read_arrow(Path(spark_or_path), dedupe)
    if path is None:
        raise TypeError("read_output(spark, path): the output directory is required")
    from runtime.files.typed import is_typed_layout

    if is_typed_layout(path):
        raise ValueError(
            f"{path} holds the typed layout (a directory per table): read one table with "
            f'spark.read.option("mergeSchema", "true").parquet("{path}/<table>")'
        )
    df = spark_or_path.read.parquet(str(path))
    return df.dropDuplicates(list(KEY_COLUMNS)) if dedupe else df


def streaming_sink_files(directory: Path) -> list[Path] | None:
    """The files Spark's streaming file sink committed into ``directory``, from its log
    ``_spark_metadata`` (one file per micro-batch and, every few, a ``.compact`` file holding
    the ones before: a first line with the log's version, then one JSON entry per file with its
    URI and ``action`` add or delete); ``None`` where there is no such log."""
    log_dir = directory / "_spark_metadata"
    if not log_dir.is_dir():
        return None
    added: set[Path] = set()
    deleted: set[Path] = set()
    for entry in log_dir.iterdir():
        if entry.name.startswith(".") or not entry.name.split(".")[0].isdigit():
            continue  # Spark's temporary and checksum files
        for line in entry.read_text().splitlines()[1:]:
            if not line.strip():
                continue
            item = json.loads(line)
            uri = urllib.parse.urlparse(item["path"])
            path = Path(urllib.request.url2pathname(uri.path))
            (deleted if item.get("action") == "delete" else added).add(path)
    return sorted(p for p in added - deleted if p.exists())


def _read_arrow(directory: Path, dedupe: bool) -> Any:
    import pyarrow as pa

    files = streaming_sink_files(directory) if directory.exists() else None
    if (
        not directory.exists()
        or (
            files is None
            and not any(
                not any(part.startswith(("_", ".")) for part in p.relative_to(directory).parts)
                for p in directory.rglob("*.parquet")
            )
        )
        or files == []
    ):
        from runtime.spark.rows import arrow_schema

        schema = arrow_schema()
        return schema.empty_table().append_column("batch", pa.array([], pa.string()))
    return _dedupe(_dataset(directory, files), dedupe)


def _dataset(directory: Path, files: list[Path] | None = None) -> Any:
    """The generic layout under ``directory`` (only ``files``, if given: all under it)."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    partitioning = ds.partitioning(
        pa.schema([("table", pa.string()), ("batch", pa.string())]), flavor="hive"
    )
    if files is not None:
        dataset = ds.dataset(
            [str(f) for f in files],
            format="parquet",
            partitioning=partitioning,
            partition_base_dir=str(directory),
        )
    else:
        dataset = ds.dataset(
            str(directory),
            format="parquet",
            partitioning=partitioning,
            exclude_invalid_files=True,
            ignore_prefixes=[".", "_"],
        )
    return dataset.to_table()


def _read_typed(directory: Path, dedupe: bool) -> Any:
    import pyarrow as pa

    from runtime.files.typed import GENERIC_KEY_COLUMNS, read_changes

    changes = read_changes(directory)
    columns = {"table": changes.column("table")}
    for typed, generic in GENERIC_KEY_COLUMNS.items():
        columns[generic] = changes.column(typed)
    columns["commit_ts"] = changes.column("_commit_ts").cast(pa.int64())
    columns["batch"] = changes.column("batch")
    return _dedupe(pa.table(columns), dedupe)


def _dedupe(table: Any, dedupe: bool) -> Any:
    import pyarrow as pa

    if not dedupe or table.num_rows == 0:
        return table
    keys = zip(*(table.column(c).to_pylist() for c in KEY_COLUMNS), strict=True)
    seen: set[tuple[Any, ...]] = set()
    keep = []
    for i, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return table if len(keep) == table.num_rows else table.take(pa.array(keep, pa.int64()))


def write_default(df: Any, output_dir: str, batch: str) -> None:
    """The default sink: parquet partitioned by table (and by batch, so a re-run of the same
    batch overwrites exactly its own files)."""
    from pyspark.sql import functions as f

    (
        df.withColumn("batch", f.lit(batch))
        .write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy("table", "batch")
        .parquet(str(Path(output_dir)))
    )


def write_staged(df: Any, staging_dir: str) -> None:
    """The default sink's write of one atomically committed micro-batch: parquet partitioned by
    table only, into ``staging_dir`` (fresh: the committer removed what an earlier attempt
    left), whose ``table=<t>`` directories the committer renames to ``table=<t>/batch=<id>``.

    A plain write into a new directory: no dynamic partition overwrite (its own staging
    directory and per-file moves) and no constant ``batch`` column, which made this write about
    a third slower than Spark's plain write (docs/benchmarks.md).

    The mode is spelt ``"error"``: Spark Connect's client knows only append, overwrite, error
    and ignore, and refuses the classic alias ``"errorifexists"`` before sending anything
    (``PySparkValueError``, UNSUPPORTED_OPERATION), which failed every micro-batch over Connect."""
    df.write.mode("error").partitionBy("table").parquet(staging_dir)
