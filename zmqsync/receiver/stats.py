"""What a receiver counts: one dict, given to each of its parts, which add to it."""

from __future__ import annotations

from typing import Any

__all__ = ["new_stats"]


def new_stats() -> dict[str, Any]:
    """A receiver's counts, all zero (``WeightReceiver.stats``)."""
    return {
        "received_bytes": 0,
        "applied": 0,
        "duplicates": 0,
        "stale": 0,
        "rejected_frames": 0,
        "last_apply_s": 0.0,
        "chunks": 0,
        "broken_streams": 0,
        "torn": 0,
        "deltas": 0,
        "deltas_skipped": 0,
        "failovers": 0,
        "device_chunks": 0,
    }
