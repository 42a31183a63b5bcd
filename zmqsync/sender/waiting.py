"""Waiting for a version's acks, and what a send raises when they do not all come."""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Iterable

import zmqsync.sender.pump as pump
from zmqsync.errors import SyncTimeout, TransportError, WeightsRejected
from zmqsync.fleet import Send
from zmqsync.sender.pump import WINDOW_WAIT
from zmqsync.sender.reporting import LATENCY_BUCKETS
from zmqsync.sender.state import SenderState
from zmqsync.sender.transfers import Pending
from zmqsync.transport.base import (
    lost_peers,
)

__all__ = ["Waiting"]

log = logging.getLogger("zmqsync.sender")


class Waiting(SenderState):
    """How a send waits for its acks (a part of WeightSender)."""

    def _await_acks(self, pending: Send) -> None:
        if len(self._runners) == 1:
            # One hub: read the acks on this thread rather than be woken by the pump,
            # which saves two thread switches per send.
            runner = self._runners[0]
            idle = False  # whether the last wait brought nothing
            while not pending.done and not self._closed:
                remaining = pending.deadline - time.monotonic()
                # Asking the transport who is lost costs; an ack that just came says
                # enough for now. (Its hub knows the lost at once; we look a tick later.)
                if remaining <= 0 or (idle and self._missing_are_lost(pending)):
                    return
                with runner.holding():
                    streaming = runner.advance()
                    wait = WINDOW_WAIT if streaming else pump.PUMP_TICK
                    incoming = runner.hub.recv_frames(min(remaining, wait))
                    idle = incoming is None and not streaming
                    while incoming is not None:
                        self._handle(incoming, runner)
                        if pending.done:
                            return
                        incoming = runner.hub.recv_frames(0)
                    self._answer_askers(runner)  # the pump is not reading this hub
            return
        with self._cond:
            while not pending.done and not self._closed and self._pump_error is None:
                remaining = pending.deadline - time.monotonic()
                if remaining <= 0 or self._missing_are_lost(pending):
                    break
                self._cond.wait(min(remaining, pump.PUMP_TICK))

    def _lost(self, workers: Iterable[int]) -> set[int]:
        """Those of ``workers`` known to be gone: they said goodbye, or their transport
        knows they are gone for good."""
        lost = {r.index: lost_peers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.gone(workers, lost)

    def _missing_are_lost(self, pending: Send) -> bool:
        """True when every worker still missing is known to be gone: waiting on is futile."""
        missing = pending.missing
        return bool(missing) and self._lost(missing) == missing

    def _finish(self, pending: Pending) -> None:
        send = pending.send
        self._await_acks(send)
        # Whoever the transfers reached, the version is whole in the sender's memory
        # before send() returns (the caller may change its weights then); a ring copy
        # stops reading them, and its streams still under way stop.
        copy = pending.copy
        copy.write_through(copy.count - 1)
        if copy.data is None or copy.live:
            copy.end()
            for runner in self._runners:
                with runner.holding():
                    runner.transfers = deque(t for t in runner.transfers if t.copy.readable)
        if copy.live:
            with self._cond:
                reading = self.fleet.may_still_read(copy.version, copy.reached)
            if reading and self.model is not None:
                # The caller may change its tensors once this returns: they move to
                # another block, and whoever reads this one reads one whole version.
                self._share(self._model_tensors.get(self.model))
        with self._cond:
            if self._pending is pending:
                self._pending = None
            missing = send.missing
            rejected = dict(send.rejected)
        if self._pump_error is not None:
            raise TransportError(
                f"the sender's transport failed: {self._pump_error}"
            ) from self._pump_error
        if missing:
            self._totals["timeouts"] += 1
            with self._cond:
                transports = {w: self.fleet.transport_of(w) for w in missing}
            raise SyncTimeout(
                self._timeout_message(send, missing),
                missing_workers=missing,
                version=send.version,
                transports=transports,
            )
        if rejected:
            details = "; ".join(f"worker {w}: {r}" for w, r in sorted(rejected.items()))
            raise WeightsRejected(
                f"version {send.version} was rejected by {len(rejected)} worker(s): {details}",
                rejections=rejected,
                version=send.version,
            )
        latency = time.monotonic() - send.started
        self._latencies.append(latency)
        self._latency_sum += latency
        self._latency_counts[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1

    def _timeout_message(self, send: Send, missing: set[int]) -> str:
        gone = self._lost(missing)
        with self._cond:
            lines = self.fleet.describe(sorted(missing), time.monotonic())
            left = {w for w in gone if self.fleet.workers[w].left is not None}
        parts = [
            lines[w]
            + (
                " (it said goodbye: its receiver closed)"
                if w in left
                else " (its transport says it is gone)"
                if w in gone
                else ""
            )
            for w in sorted(missing)
        ]
        waited = "" if gone == missing else f" within {self.timeout:g}s"
        return (
            f"{len(missing)} worker(s) did not ack version {send.version} of "
            f"{self.model_id!r}{waited}: " + "; ".join(parts)
        )
