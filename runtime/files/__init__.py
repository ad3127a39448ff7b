"""The file output: everything that writes the output as files, without Spark.

* ``sink`` — ``FileSink`` (``--sink files``): buffers batches into micro-batches, writes their
  parquet files (the typed per-table layout, or the generic one) or Delta data files, and
  commits them; ``read_rows`` reads the committed rows back.
* ``commit`` — ``Committer``: the atomic micro-batch commit (staging, manifest, renames or
  Delta commits, progress files, fences), shared with the Spark bridge's default output.
* ``typed`` — the typed layout's files: writing a micro-batch's tables, reading them back.

The per-partition bookkeeping of a sink (dedup tails, gaps, the failure cascade, fence keys) is
the pure ``protocol.ledger``; the sink is its shell.
"""
