"""Set-up for the whole test session, before any test module is imported."""

import pytest

from runtime import compat

# Some test modules import gRPC at import time (the Spanner fixtures). Turn its fork handlers off
# first, as the runtime does before it creates a Spanner client: with them on, Spark's JVM launcher
# dies in a process whose Spanner client threads run (runtime.compat.disable_grpc_fork_support).
compat.disable_grpc_fork_support()


# Longest first. scripts/test spreads the real-part tests over two workers file by file, and
# pytest-xdist would hand out the files with the most tests first, leaving a slow file of one or
# two tests (a Spark cluster, a killed JVM) to run alone at the end while the other worker idles.
# So the slowest files go first, in this order (seconds per file, both workers busy, from
# `--durations` on this project's CI), and scripts/test keeps the collection order
# (`--no-loadscope-reorder`). Files not named keep their order after these; tests inside a file
# keep theirs. The list is a schedule, not a rule: a file missing from it only runs later.
SLOWEST_FIRST = (
    "test_faultsim.py",  # the pure half's slowest (the seeded fault simulator)
    "test_faults_spark.py",  # ~280 s: three killed JVMs
    "test_spark_delta.py",  # ~240 s
    "test_spark_cluster_loss.py",  # ~150 s
    "test_spark_connect.py",  # ~160 s
    "test_faults_connect.py",  # ~75 s: a Connect server restarted
    "test_spark_cluster.py",  # ~100 s: a standalone cluster
    "test_spark_typed_cluster.py",  # ~100 s: a standalone cluster
    "test_spark_job_timeout.py",  # ~110 s
    "test_cli.py",
    "test_spark_dead_letter.py",
    "test_spanner_ledger.py",  # ~80 s: the emulator frozen past the stall timeout
    "test_lake_cli.py",
    "test_spark_streaming_typed.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
