"""The command-line runtime behind ``python -m actors.runtime``: the pipeline, its sinks, the
``status`` and ``dlq`` subcommands."""
