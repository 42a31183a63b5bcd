"""Which blocks of a layout's stream changed in which version (the sender's ``delta=True``).

A worker that holds an older version is sent only the blocks changed since, as long as
they are few; digests of the blocks, not a copy of the last version, tell which changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

import numpy as np
import xxhash

from zmqsync.chunking.layout import StreamLayout
from zmqsync.protocol import Buffer

__all__ = ["DELTA_BLOCK", "DELTA_MAX_SHARE", "DeltaTracker"]

#: The stretch of a stream one digest covers (``delta=True``): a delta moves whole
#: blocks, so a change of one byte sends one block.
DELTA_BLOCK: Final = 1024 * 1024
#: A delta larger than this share of the whole version goes whole (any worker can apply
#: a whole version; few gain from a delta that large).
DELTA_MAX_SHARE: Final = 0.5


class DeltaTracker:
    """Which blocks of a layout's stream changed in which version (``delta=True``).

    :meth:`record` takes each version's stream, whole, in the order versions are made:
    a block whose digest (XXH3-128 of its bytes) differs from the one recorded before is
    marked as changed in that version. :meth:`spans` then says which stretches a worker
    that holds version ``base`` lacks: every block changed after ``base``. Digests, not
    a copy of the previous version, so that it costs no memory the size of the model: a
    128-bit hash of the block's bytes (its chance of missing a change is 2^-128).
    """

    def __init__(self, layout: StreamLayout, block: int = DELTA_BLOCK) -> None:
        self.layout = layout
        self.block = block
        n = max(1, -(-layout.total // block))
        self._digests: list[bytes] = [b""] * n
        self._changed = np.zeros(n, dtype=np.int64)
        #: The first version recorded: a delta against an older one is not known.
        self.since: int | None = None
        self.latest = -1

    def record(self, version: int, read: Callable[[int, int], Iterable[Buffer]]) -> int:
        """Take ``version``'s whole stream, whose bytes ``[lo, hi)`` are ``read(lo, hi)``
        (in parts); returns how many blocks it changed."""
        if version < self.latest:
            raise ValueError(f"version {version} recorded after {self.latest}")
        again = version == self.latest  # its weights changed under the same number
        block, digests, changed = self.block, self._digests, 0
        total = self.layout.total
        for k in range(len(digests)):
            hasher = xxhash.xxh3_128()
            for part in read(k * block, min((k + 1) * block, total)):
                hasher.update(part)
            d = hasher.digest()
            if d != digests[k]:
                digests[k] = d
                self._changed[k] = version
                changed += 1
        if self.since is None or again:
            # Workers may hold either weights of a version recorded twice: no delta
            # against it is known.
            self.since = version + 1 if again else version
        self.latest = version
        return changed

    def chunks_changed(self, version: int) -> list[int]:
        """The chunks of the layout that hold a block ``version`` changed."""
        per = self.layout.chunk_bytes
        out: set[int] = set()
        for k in np.flatnonzero(self._changed == version).tolist():
            lo, hi = k * self.block, min((k + 1) * self.block, self.layout.total)
            out.update(range(lo // per, max(lo, hi - 1) // per + 1))
        return sorted(out)

    def spans(self, base: int, max_bytes: int) -> list[tuple[int, int]] | None:
        """``(offset, length)`` stretches, each at most ``max_bytes``, holding every block
        changed after ``base`` (at least one stretch, maybe empty); None if a delta
        against ``base`` is unknown or not worth it (see :data:`DELTA_MAX_SHARE`)."""
        if self.since is None or not self.since <= base <= self.latest:
            return None
        total, block = self.layout.total, self.block
        changed = np.flatnonzero(self._changed > base)
        if len(changed) * block > DELTA_MAX_SHARE * max(total, 1):
            return None
        spans: list[tuple[int, int]] = []
        if len(changed):
            # Runs of consecutive blocks, each cut into stretches of at most max_bytes.
            breaks = np.flatnonzero(np.diff(changed) != 1) + 1
            for run in np.split(changed, breaks):
                start = int(run[0]) * block
                stop = min((int(run[-1]) + 1) * block, total)
                for at in range(start, stop, max_bytes):
                    spans.append((at, min(max_bytes, stop - at)))
        return spans or [(0, 0)]  # nothing changed: one empty chunk carries the version
