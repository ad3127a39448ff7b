"""Set-up for the whole test session, before any test module is imported."""

from runtime import compat

# Some test modules import gRPC at import time (the Spanner fixtures). Turn its fork handlers off
# first, as the runtime does before it creates a Spanner client: with them on, Spark's JVM launcher
# dies in a process whose Spanner client threads run (runtime.compat.disable_grpc_fork_support).
compat.disable_grpc_fork_support()
