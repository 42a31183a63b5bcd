"""The messages a receiver refused: counted, the last few kept, each logged."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Final

__all__ = ["KEPT_REJECTIONS", "Rejections"]

log = logging.getLogger("zmqsync.receiver")

#: How many reasons a receiver keeps for its status: the latest tell what is wrong.
KEPT_REJECTIONS: Final = 8


class Rejections:
    """What a receiver refused: ``stats["rejected_frames"]`` counts them, :attr:`recent`
    keeps the last few reasons. Its parts each report theirs here."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats
        self.recent: deque[str] = deque(maxlen=KEPT_REJECTIONS)

    def add(self, worker: int | None, reason: str) -> None:
        """Worker ``worker`` refused a message for ``reason``."""
        self._stats["rejected_frames"] += 1
        self.recent.append(reason)
        log.warning("worker %s rejected a message: %s", worker, reason)
