"""A received version's byte stream gathered in one buffer (the receiver's staging).

Chunks land in it as they come; once the last came, the whole version is applied in one
go (:class:`~zmqsync.tensors.apply.ApplyPlan`), so the model is locked only for that copy.
"""

from __future__ import annotations

import numpy as np

from zmqsync.protocol import Buffer, Weights, WeightsSchema

__all__ = ["Staging"]


class Staging:
    """A version's byte stream gathered in one buffer, kept and reused between versions."""

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None
        self.total = 0

    def start(self, total: int) -> None:
        """Get ready for a stream of ``total`` bytes (reusing the buffer if it fits)."""
        if self._buffer is None or len(self._buffer) != total:
            self._buffer = None  # let the old one go first: at most one is held
            self._buffer = np.empty(total, dtype=np.uint8)
        self.total = total

    def write(self, offset: int, payload: Buffer) -> None:
        assert self._buffer is not None
        source = np.frombuffer(payload, dtype=np.uint8)
        np.copyto(self._buffer[offset : offset + len(source)], source)

    def weights(self, model_id: str, version: int, epoch: int, schema: WeightsSchema) -> Weights:
        """The gathered version (its one buffer is this staging's memory)."""
        assert self._buffer is not None
        return Weights(model_id, version, epoch, schema, (self._buffer.data,))

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else len(self._buffer)

    @property
    def array(self) -> np.ndarray:
        assert self._buffer is not None
        return self._buffer

    def release(self) -> None:
        self._buffer = None

    def hand_over(self, spare: np.ndarray | None, *, keep: bool) -> None:
        """Go on in ``spare`` (fresh memory if None or of another size): the buffer held
        so far is someone else's now (the snapshot a relay serves, which must stay that
        version's bytes). ``keep``: copy its bytes over first (a delta patches them)."""
        held = self._buffer
        if held is None:
            return
        if spare is None or len(spare) != len(held):
            spare = np.empty_like(held)
        if keep:
            np.copyto(spare, held)
        self._buffer = spare
