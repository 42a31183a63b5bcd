"""How fast a worker reads a version's chunks, and when it tells its sender.

A sender cannot see how far a chunk it handed to its transport got: on a slow link the
oldest chunk of its window is held as long as a stopped worker would hold it. What tells
them apart is the worker: one that reads says so (a :class:`~zmqsync.protocol.Reading`
note) as each chunk comes, when chunks come slowly; a stopped one says nothing.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NOTE_GAP", "ReadPace"]

#: Chunks that come at least this far apart (seconds) are noted to the sender, at most
#: one note this often: a worker on a fast link says nothing.
NOTE_GAP: Final = 0.05


class ReadPace:
    """The longest gap between a worker's chunks in its last two versions, and when it
    last told its sender (one per upstream session: a sharded learner's ranks each have
    one). The longest, not the last: a version's last chunk is often a small one that
    comes right after the one before, and says nothing of how long a full one takes."""

    __slots__ = ("_current", "_last_chunk", "_last_note", "_noted", "_previous", "gap")

    def __init__(self) -> None:
        #: Seconds: the longest gap between two chunks of the version being read or of
        #: the one before it (0.0: none yet).
        self.gap = 0.0
        self._current = 0.0  # the longest gap in the version being read
        self._previous = 0.0  # ... and in the one before
        self._last_chunk: float | None = None
        self._last_note = float("-inf")
        self._noted = 0.0  # the gap the sender was last told

    def chunk(self, first: bool, last: bool, now: float) -> float | None:
        """A chunk was read at ``now`` (``first``, ``last``: the first, the last of its
        version): the gap to tell the sender now, or None. A slow reader tells it at
        every chunk but the last (whose ack says more), at most one note every
        :data:`NOTE_GAP`; a fast one only once, that its pace is back."""
        if first:
            self._previous, self._current = self._current, 0.0
        elif self._last_chunk is not None:
            self._current = max(self._current, now - self._last_chunk)
        self._last_chunk = now
        self.gap = max(self._current, self._previous)
        if last or (self.gap < NOTE_GAP and self._noted < NOTE_GAP):
            return None  # fast, and the sender knows it
        if now - self._last_note < NOTE_GAP:
            return None
        self._last_note, self._noted = now, self.gap
        return self.gap
