"""Simulation and in-memory ports: the seeded change-stream model (``stream``), the simulated
change-stream source built on it (``source``), the in-memory sync log, membership and sink
(``memory``), and the deterministic many-task fault simulator (``faultsim``) that runs the
protocol cores of ``protocol/`` against them. Real adapters live beside this package
(``runtime/kafka``, ``runtime/spanner``, ``runtime/spark``); these exist for demos, benchmarks and
the deterministic tests."""
