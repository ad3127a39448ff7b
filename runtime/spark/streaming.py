"""The Structured Streaming path (see ``StreamingBackend``)."""

from __future__ import annotations

from typing import Any


class StreamingBackend:
    def __init__(self, spark: Any, config: Any, foreach_batch: Any) -> None:
        raise NotImplementedError("the streaming path is not built yet")

    def start(self) -> None: ...

    def stop(self) -> None: ...
