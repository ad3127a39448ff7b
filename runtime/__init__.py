"""Adapters between shoal's actors and the outside world: Kafka, Spanner, Spark, launchers,
configuration and metrics. The in-memory ports used by the deterministic simulator live here too."""

import os as _os

# gRPC (the Spanner client) installs fork handlers that break a later fork/exec in the same
# process while its threads run: Spark's JVM launcher then dies at once ("Java gateway process
# exited before sending its port number"), as seen with the Spanner and Spark paths in one
# process. Set before gRPC is first imported; a value the user set wins.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
