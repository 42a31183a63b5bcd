"""The lock a forward pass holds to see one whole version, which also refuses forward
passes while the model is torn."""

from __future__ import annotations

import threading
import time

from zmqsync.errors import TornWeights

__all__ = ["WeightsLock"]


class WeightsLock:
    """The lock a forward pass holds to see one whole version: ``with receiver.lock:``.

    Re-entrant, like ``threading.RLock``. While an in-place version is being written
    (from its first chunk to its last, whichever threads deliver them), acquiring it
    waits. While the model is torn (an in-place version's stream broke), acquiring it
    waits for the repair up to ``timeout`` seconds (the ``timeout`` argument, or the
    receiver's) and then raises :class:`~zmqsync.errors.TornWeights`: a forward pass
    never runs on torn weights.
    """

    def __init__(self, timeout: float) -> None:
        #: What the receiver itself writes under (it may write a torn model).
        self.raw = threading.RLock()
        self._repaired = threading.Condition(self.raw)
        #: ``(version, reason)`` while the model is torn, else None.
        self.torn: tuple[int, str] | None = None
        #: True while an in-place version is being written.
        self.writing = False
        self.timeout = timeout

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        again = self._is_owned()  # re-entrant: this thread already holds it
        if not self.raw.acquire(blocking, timeout):
            return False
        if again or (self.torn is None and not self.writing):
            return True
        start = time.monotonic()
        while self.writing and self.torn is None:
            # An in-place version is going in: it ends whole or torn (a gap between
            # chunks longer than the receiver's chunk_timeout breaks it).
            remaining = None if timeout < 0 else timeout - (time.monotonic() - start)
            if not blocking or (remaining is not None and remaining <= 0):
                self.raw.release()
                return False
            self._repaired.wait(remaining)
        if self.torn is None:
            return True
        deadline = time.monotonic() + (self.timeout if timeout < 0 else timeout)
        while self.torn is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not blocking:
                version, reason = self.torn
                self.raw.release()
                raise TornWeights(
                    f"the model is torn: version {version}'s stream broke while it was "
                    f"written in place ({reason}), and no repair came within "
                    f"{max(0.0, deadline - time.monotonic() + remaining):.3g}s",
                    version=version,
                    reason=reason,
                )
            self._repaired.wait(remaining)
        return True

    def release(self) -> None:
        self.raw.release()

    def _is_owned(self) -> bool:
        """Whether this thread holds it (``threading.RLock``'s own test)."""
        return bool(self.raw._is_owned())  # type: ignore[attr-defined]

    def __enter__(self) -> WeightsLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def begin_write(self) -> None:
        """An in-place version starts: forward passes wait from now (once those under
        way are done) until :meth:`end_write`, from whichever thread."""
        with self.raw:
            self.writing = True

    def end_write(self) -> None:
        """The in-place version is in, whole or torn (call holding :attr:`raw`)."""
        self.writing = False
        self._repaired.notify_all()

    def tear(self, version: int, reason: str) -> None:
        """Mark the model torn (call holding :attr:`raw`)."""
        self.torn = (version, reason)

    def mend(self) -> None:
        """A whole version is in the model again (call holding :attr:`raw`)."""
        if self.torn is not None:
            self.torn = None
            self._repaired.notify_all()
