"""What a sender's pumps do with each message from a worker: the fleet core decides,
this carries its effects out on the hubs; and how long a stopped worker may hold a chunk."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any, Final

from zmqsync.errors import FrameError
from zmqsync.fleet import Admit, FanOut, Forget, Origin, Reply, SendLatest
from zmqsync.protocol import (
    ErrorMessage,
    Hello,
    Kind,
    StatusReply,
    StatusRequest,
    UpToDate,
    decode,
    encode,
    peek_kind,
)
from zmqsync.sender.pump import HubRunner
from zmqsync.sender.state import SenderState
from zmqsync.transport.base import (
    AdmitsPeers,
    ForgetsPeers,
    HubTransport,
    Incoming,
    PeerId,
    reserved_workers,
)

__all__ = ["ACCEPTED", "Handling"]

log = logging.getLogger("zmqsync.sender")

#: What a worker may send to a sender; anything else is refused before it is decoded
#: (a weights message sent to a sender would otherwise be parsed and held for nothing).
ACCEPTED: Final = frozenset(
    {Kind.ACK, Kind.HELLO, Kind.SNAPSHOT_REQUEST, Kind.PROBE_REQUEST, Kind.GOODBYE}
)
#: A chunk held this long (seconds), and far longer than chunks usually take, counts as
#: held by a stopped peer: the window goes on without it. The peer's transport queue then
#: fills, its later chunks are dropped and its stream breaks; it is repaired once back.
STALL_MIN: Final = 0.25
STALL_MAX: Final = 10.0
#: How many times the usual release time a chunk may take before it counts as stalled.
STALL_FACTOR: Final = 8.0
#: For this long after a stall, a stopped peer is known to be about: chunks it pins are
#: waited for only a little (its transport queue fills within a few windows, and each
#: would otherwise cost the whole fleet a full stall limit).
STALL_MEMORY: Final = 5.0
STALL_KNOWN: Final = 0.02
#: Status requests a hub keeps while a send waits for acks, answered together with one
#: report; further askers are dropped, and ask again.
STATUS_WAITING: Final = 64
#: While a send waits for acks, a report is built at most this often (seconds), for
#: every asker since: a flood of status requests costs a send one report a second (a
#: few ms, the rows being bounded), and `zmqsync status` still answers while a send
#: waits on a dead worker.
STATUS_INTERVAL: Final = 1.0
#: A message whose handling failed is logged at most this often (seconds); each is counted.
ERROR_LOG_INTERVAL: Final = 10.0


class Handling(SenderState):
    """How a sender's pumps handle what workers send (a part of WeightSender)."""

    def _pump_failed(self, exc: BaseException) -> None:
        if not self._closed:
            log.exception("zmqsync sender pump stopped", exc_info=exc)
            self._pump_error = exc
            with self._cond:
                self._cond.notify_all()

    def _refuse(self, runner: HubRunner, peer: PeerId | None, code: str, reason: str) -> None:
        with self._cond:
            self.fleet.reject(reason)
        # Counted in status; not a warning each, or a flood of junk would flood the log.
        log.debug("rejected a message: %s", reason)
        if peer is not None:
            runner.hub.send_frames(
                encode(ErrorMessage(self.model_id, code, reason[:500])), to=[peer]
            )

    def _handle(self, incoming: Incoming, runner: HubRunner) -> None:
        """One message from a hub: refuse what is never accepted unread, let the fleet
        core decide the rest, and carry out its effects.

        No message ends the pump (or the send that reads it): an error while handling
        one is counted (``message_errors``) and logged, and the next message is read.
        """
        try:
            self._handle_message(incoming, runner)
        except Exception as exc:
            self._totals["message_errors"] += 1
            with self._cond:
                self.fleet.reject(f"handling a message failed: {type(exc).__name__}: {exc}")
            now = time.monotonic()
            if now - self._last_error_log >= ERROR_LOG_INTERVAL:
                self._last_error_log = now
                log.exception("zmqsync sender: handling a message failed; going on")

    def _handle_message(self, incoming: Incoming, runner: HubRunner) -> None:
        frames, peer = incoming.frames, incoming.peer
        kind = peek_kind(frames[0]) if frames else None
        if peer is None and kind is not Kind.ACK:
            # The ack channel carries acks only, from nobody in particular: no reply.
            with self._cond:
                self.fleet.counters["forged"] += 1
            what = kind.name if kind is not None else "a non-zmqsync"
            self._refuse(runner, None, "", f"{what} message on the ack channel, dropped unread")
            return
        if kind is not None and kind not in ACCEPTED and kind is not Kind.STATUS_REQUEST:
            self._refuse(runner, peer, "unexpected", f"{kind.name} message at a sender, unread")
            return
        try:
            message = decode(frames)
        except FrameError as exc:
            self._refuse(runner, peer, "malformed", f"malformed message: {exc}")
            return
        if isinstance(message, StatusRequest):
            if peer is not None:
                self._status_asked(runner, peer)
            return
        reserved = (
            {r.index: reserved_workers(r.hub) for r in self._runners}
            if isinstance(message, Hello)
            else None
        )
        with self._cond:
            effects = self.fleet.handle(
                message,
                Origin(runner.index, peer),
                time.monotonic(),
                reserved,
                credential=incoming.credential,
            )
            if self._pending is not None:
                self._cond.notify_all()
        self._carry_out(effects, runner)

    def _status_asked(self, runner: HubRunner, peer: PeerId) -> None:
        """Answer a status request now, or, while a send waits for acks, with the next
        report (see STATUS_INTERVAL)."""
        waiting = runner.status_askers
        if peer not in waiting:
            if len(waiting) >= STATUS_WAITING:
                self._totals["status_dropped"] += 1
                return
            waiting.append(peer)
        if not self._answer_askers(runner):
            self._totals["status_deferred"] += 1

    def _answer_askers(self, runner: HubRunner) -> bool:
        """Send the hub's waiting askers one report, unless a send waits for acks and
        one went out less than STATUS_INTERVAL ago; True if none wait any more."""
        if not runner.status_askers:
            return True
        now = time.monotonic()
        if self._send_waiting() and now - runner.status_at < STATUS_INTERVAL:
            return False
        askers = list(runner.status_askers)
        runner.status_askers.clear()
        runner.status_at = now
        self._answer_status(runner, askers)
        return True

    def _send_waiting(self) -> bool:
        """Whether a send waits for acks now (until they came, or its deadline)."""
        pending = self._pending
        if pending is None:
            return False
        send = pending.send
        return not send.done and time.monotonic() < send.deadline

    def _answer_status(self, runner: HubRunner, peers: Iterable[PeerId]) -> None:
        reply = encode(StatusReply(self.model_id, self.version, self.epoch, self.status()))
        for peer in peers:
            runner.hub.send_frames(reply, to=[peer])

    def _carry_out(self, effects: Iterable[Any], runner: HubRunner) -> None:
        """Do what the fleet core decided, on this runner's hub (which this thread
        holds); effects for other hubs wait for their own pump."""
        for effect in effects:
            hub_index = effect.hub if isinstance(effect, FanOut) else effect.origin.hub
            if hub_index != runner.index:
                self._runners[hub_index].later.append(effect)
                continue
            hub = runner.hub
            if isinstance(effect, Reply):
                if effect.origin.peer is not None:
                    hub.send_frames(encode(effect.message), to=[effect.origin.peer])
            elif isinstance(effect, SendLatest):
                if effect.origin.peer is None:
                    continue
                if runner.forwarding_to(effect.origin.peer):
                    # A relay's next version is still streaming to it: what it lacks is
                    # on its way (what it asks for once it is all sent, it lost).
                    self._totals["repairs_skipped"] += 1
                    continue
                latest = self._latest()
                if latest is None:
                    self._unserved(effect, hub)
                elif runner.repair(latest, effect.origin.peer):
                    self._totals["repairs_sent"] += 1
                    self._totals["repair_bytes"] += latest.nbytes
                else:
                    self._totals["repairs_skipped"] += 1
            elif isinstance(effect, FanOut):
                hub.send_frames(encode(effect.message))
            elif (
                isinstance(effect, Admit)
                and effect.origin.peer is not None
                and isinstance(hub, AdmitsPeers)
            ):
                hub.peer_joined(effect.origin.peer)
            elif (
                isinstance(effect, Forget)
                and effect.origin.peer is not None
                and isinstance(hub, ForgetsPeers)
            ):
                hub.peer_left(effect.origin.peer)

    def _unserved(self, effect: SendLatest, hub: HubTransport) -> None:
        """A worker needs the latest version and the sender keeps none: it is told so,
        and gets the next version. Version 0 changed in place since it was published:
        told it is on its way, so that its connect() waits for the first send."""
        assert effect.origin.peer is not None
        message = effect.otherwise
        if self.version == 0 and isinstance(message, UpToDate):
            message = dataclasses.replace(message, in_flight=True)
        hub.send_frames(encode(message), to=[effect.origin.peer])

    def _released_after(self, seconds: float) -> None:
        """A chunk was let go of ``seconds`` after it was sent (an upper bound)."""
        self._release_time += 0.2 * (seconds - self._release_time)

    def _stall_limit(self) -> float:
        """How long a chunk may be held before its holder counts as stopped."""
        limit = min(STALL_MAX, max(STALL_MIN, STALL_FACTOR * self._release_time))
        if time.monotonic() - self._last_stall < STALL_MEMORY:
            return min(limit, max(STALL_KNOWN, 2 * self._release_time))
        return limit

    def _housekeeping(self, runner: HubRunner) -> None:
        """Between messages (the pump, holding ``runner``'s baton): expire quiet
        sessions once a heartbeat, and carry out effects meant for this hub."""
        now = time.monotonic()
        if now - self._last_expiry >= self.heartbeat:
            self._last_expiry = now
            with self._cond:
                effects = self.fleet.expire(now)
            self._carry_out(effects, runner)
        while runner.later:
            self._carry_out([runner.later.popleft()], runner)
        self._answer_askers(runner)

    def free_worker_id(self) -> int:
        """The lowest worker id that no session holds and no hub reserves (a pipe's or
        an actor's index): what a worker that asks for an id gets."""
        reserved = {r.index: reserved_workers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.free_worker_id(reserved)
