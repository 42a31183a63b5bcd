"""The fleet's rules, sans-IO: :class:`Fleet` takes ``(message, origin, now)`` and
returns the effects its shell (:class:`~zmqsync.sender.WeightSender`) carries out. It
holds no sockets, threads, locks or torch; the rules are listed in the package's
docstring, and each is enforced here and nowhere else.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

from zmqsync.fleet.records import (
    REASON_CHARS,
    REASONS_KEPT,
    Admit,
    Effect,
    FanOut,
    Forget,
    Origin,
    Reply,
    Send,
    SendLatest,
    Session,
    parse_below,
)
from zmqsync.fleet.sends import FleetSends
from zmqsync.protocol import (
    AUTO_WORKER,
    Ack,
    ErrorMessage,
    Goodbye,
    Hello,
    Message,
    Probe,
    ProbeRequest,
    Reading,
    SnapshotRequest,
    UpToDate,
    Welcome,
)
from zmqsync.transport.base import RELAY_CREDENTIAL, PeerId

__all__ = [
    "EXPIRE_HEARTBEATS",
    "EXPIRE_MIN_SECONDS",
    "MAX_CLAIMS",
    "MAX_SESSIONS",
    "READ_GAP_MAX",
    "READ_SILENCE",
    "REPAIR_RETRY",
    "Fleet",
]

#: A session not heard from for this many heartbeats, and at least EXPIRE_MIN_SECONDS
#: (or that long after its goodbye), is dropped, and its id may be handed out again: a
#: crashed worker says no goodbye. The floor spares a worker paused for a few seconds
#: (a long GC, a stopped container) where heartbeats are short.
EXPIRE_HEARTBEATS: Final = 30
EXPIRE_MIN_SECONDS: Final = 30.0
#: Sessions a sender keeps at most: thousands of workers fit, a flood of hellos does not.
MAX_SESSIONS: Final = 16_384
#: Workers that relays may claim, all relays together: each claim is a row the sender
#: keeps, so a flood of relay sessions each naming MAX_BELOW workers stays bounded.
MAX_CLAIMS: Final = MAX_SESSIONS
#: A session's probes are answered at most this often (each goes to every subscriber).
PROBE_INTERVAL: Final = 0.005
#: A repair the sender turned down (the version was still on its way to the worker)
#: holds back the worker's next asks this long (seconds) at most, not repair_after.
REPAIR_RETRY: Final = 1.0
#: A worker that said it reads slowly (its Reading notes) counts as reading while it
#: was heard from within this many of its gaps between chunks...
READ_SILENCE: Final = 2.0
#: ...and a gap it claims counts for this many seconds at most.
READ_GAP_MAX: Final = 10.0


class Fleet(FleetSends):
    """The sender's view of its workers, and the rules for every message they send.

    Args:
        model_id, epoch, mode, strategy: what Welcomes and replies say.
        transports: each hub's name, by hub index (shown in status).
        announced: each hub's extra addresses for its Welcome (data and ack endpoints).
        ranks: a sharded learner's ranks' endpoints, which its Welcome names (each rank
            sends its part of every version; a worker opens a session with each).
        part: which of those ranks this sender is (its part of every version), or None.
        num_workers: the fleet's size, or None for "whoever connected".
        heartbeat: the workers' heartbeat interval (liveness and expiry count in it).
        repair_after: the least time between two sends of the latest version to one worker.
        max_sessions: the most sessions kept at once.
    """

    def __init__(
        self,
        model_id: str,
        epoch: int,
        *,
        mode: str,
        strategy: str,
        transports: Sequence[str],
        announced: Sequence[Mapping[str, Any]] = (),
        num_workers: int | None = None,
        heartbeat: float = 1.0,
        repair_after: float = 1.0,
        max_sessions: int = MAX_SESSIONS,
        ranks: Sequence[str] = (),
        part: int | None = None,
    ) -> None:
        self.model_id = model_id
        self.ranks = tuple(ranks)
        self.part = part
        self.epoch = epoch
        self.mode = mode
        self.strategy = strategy
        self.transports = list(transports)
        self.announced = list(announced) or [{} for _ in self.transports]
        self.num_workers = num_workers
        self.heartbeat = heartbeat
        self.repair_after = repair_after
        self.max_sessions = max_sessions
        self.version = 0
        #: Whether the latest version (0: the weights the sender started with) can be
        #: sent: a joining worker is then given it.
        self.published = False
        #: The newest version sent to every worker (not a targeted send).
        self.broadcast_version = 0
        self.pending: Send | None = None
        self.workers: dict[int, Session] = {}
        self._by_origin: dict[Origin, int] = {}
        #: Workers behind relays, from the relays' heartbeats: worker id -> the relay's.
        #: A claim, not a session: one live claimer per worker (see _claim).
        self.claims: dict[int, int] = {}
        self.counters: dict[str, int] = {
            "rejected_frames": 0,
            "forged": 0,
            "refused_claims": 0,
            "expired": 0,
            "goodbyes": 0,
            "stray_goodbyes": 0,
            "probes_limited": 0,
        }
        self.reasons: deque[str] = deque(maxlen=REASONS_KEPT)

    # --- liveness ------------------------------------------------------------------

    def reading(
        self,
        hub: int,
        peers: Collection[PeerId] | None,
        chunk: tuple[int, int],
        since: float,
        now: float,
    ) -> bool:
        """Whether a worker of ``hub`` (among ``peers``; None: any) that has not yet said
        it read ``chunk`` (version, index) sent at ``since`` reads slowly and still reads
        at ``now``: it says so as chunks come (Reading notes), and its last note, or the
        chunk if sent later, is within :data:`READ_SILENCE` of its gaps between chunks.
        Such a worker may hold the chunk on a slow link; a stopped one goes quiet. Its
        heartbeats do not count: a worker that waits for the next chunk (it read this one
        but has not said so yet: notes come at most every 50 ms, and not for a version's
        last chunk) sends them too, and would hold the window to STALL_MAX. Safe from any
        thread (it reads a snapshot)."""
        for s in list(self.workers.values()):
            if (
                s.read_gap > 0.0
                and s.left is None
                and s.origin.hub == hub
                and (peers is None or s.origin.peer in peers)
                and s.read < chunk
                and (s.read_quiet is None or chunk[0] > s.read_quiet[0])
                and now - max(s.read_at, since) <= READ_SILENCE * s.read_gap
            ):
                return True
        return False

    def read_stalled(
        self,
        hub: int,
        peers: Collection[PeerId] | None,
        chunk: tuple[int, int],
        quiet: bool = False,
    ) -> None:
        """The window waited for ``chunk`` on the word of workers that said they read it,
        and gave up: as long as it waits for any chunk, or (``quiet``) once they had been
        quiet for two of their gaps. Whoever of them has not read it yet is not believed
        again (its session waits as a stopped worker's would): a worker that lies about
        its pace holds the fleet up once or twice in its session, not at every chunk
        (twice: quiet, forgiven, quiet again). But one that went quiet,
        for the first time in its session, is believed again for the chunks of later
        versions, at the pace its notes tell meanwhile: its link may have become slower
        than the pace it last told (a stopped worker says nothing, and its word counts
        for two of its old gaps once more). Not within the same version: its chunks may
        have come slowly there because the window waited, and its word would hold the
        window again for chunks that another worker holds."""
        for s in list(self.workers.values()):
            if (
                s.read_gap > 0.0
                and s.origin.hub == hub
                and (peers is None or s.origin.peer in peers)
                and s.read < chunk
                and (s.read_quiet is None or chunk[0] > s.read_quiet[0])
            ):
                if quiet and not s.read_forgiven:
                    s.read_quiet, s.read_forgiven = chunk, True
                else:
                    s.read_gap, s.read_doubted = 0.0, True

    def expire(self, now: float) -> list[Effect]:
        """Drop sessions quiet for :data:`EXPIRE_HEARTBEATS` heartbeats (or gone that
        long): their ids are free again, and a late message of theirs counts for nothing."""
        limit = max(EXPIRE_HEARTBEATS * self._beat, EXPIRE_MIN_SECONDS)
        effects: list[Effect] = []
        for s in list(self.workers.values()):
            if now - (s.last_seen if s.left is None else s.left) >= limit:
                self._drop(s)
                self.counters["expired"] += 1
                if s.left is None:
                    effects.append(Forget(s.origin))
        return effects

    def _drop(self, s: Session) -> None:
        self._unclaim(s)
        del self.workers[s.worker]
        if self._by_origin.get(s.origin) == s.worker:
            del self._by_origin[s.origin]
        p = self.pending
        if p is not None:
            # What it answered counted for that session only: a new one answers anew.
            p.acked.discard(s.worker)
            p.rejected.pop(s.worker, None)

    # --- messages ------------------------------------------------------------------

    def handle(
        self,
        message: Message,
        origin: Origin,
        now: float,
        reserved: Mapping[int, frozenset[int]] | None = None,
        *,
        credential: str | None = None,
    ) -> list[Effect]:
        """Everything a message from a worker changes, and the effects to carry out.

        ``reserved``: per hub, the worker ids bound to its peers (pipe and actor
        indices); needed for a Hello only. ``credential``: who the peer proved to be,
        where its hub authenticates peers (see ``Incoming``); a session whose hello came
        with one may claim workers below it only if it names a relay.
        """
        if message.model_id != self.model_id:
            reason = (
                f"message for model {message.model_id!r} reached the sender of {self.model_id!r}"
            )
            return self._refuse(origin, "wrong-model", reason)
        if origin.peer is None and not isinstance(message, Ack):
            # The ack channel identifies nobody: anything else there is refused unread.
            self.reject(f"{type(message).__name__} on the ack channel (acks only)")
            self.counters["forged"] += 1
            return []
        if isinstance(message, Ack):
            return self._on_ack(message, origin, now)
        if isinstance(message, Hello):
            return self._on_hello(message, origin, now, reserved or {}, credential)
        if isinstance(message, SnapshotRequest | ProbeRequest | Goodbye | Reading):
            session = self._authenticate(message.worker, message.session, origin)
            if session is None:
                self.counters["forged"] += 1
                if isinstance(message, Goodbye):
                    # Not answered: its sender is leaving, and an answer would reach
                    # whoever speaks from that address next (a Ray actor's next
                    # receiver, handed a closed one's last words to this sender).
                    self.reject(f"Goodbye of worker {message.worker} without its session")
                    return []
                return self._refuse(
                    origin,
                    "unknown-session",
                    f"{type(message).__name__} of worker {message.worker} does not carry the "
                    "session of its Welcome (expired, taken over, or forged): say hello again",
                )
            session.last_seen = now
            if isinstance(message, Reading):
                return self._on_reading(message, session, now)
            if isinstance(message, SnapshotRequest):
                return self._on_snapshot_request(message, session, now)
            if isinstance(message, ProbeRequest):
                return self._on_probe(message, session, now)
            return self._on_goodbye(session, now)
        return self._refuse(
            origin, "unexpected", f"unexpected {type(message).__name__} message at the sender"
        )

    def reject(self, reason: str, worker: int | None = None) -> None:
        """Count a message refused (malformed, forged, stray)."""
        reason = reason[:REASON_CHARS]
        self.counters["rejected_frames"] += 1
        self.reasons.append(reason)
        s = self.workers.get(worker) if worker is not None else None
        if s is not None:
            s.rejected_frames += 1
            s.rejections.append(reason)

    def _refuse(self, origin: Origin, code: str, reason: str) -> list[Effect]:
        self.reject(reason)
        if origin.peer is None:
            return []
        return [Reply(origin, ErrorMessage(self.model_id, code, reason))]

    def _authenticate(self, worker: int, secret: str, origin: Origin) -> Session | None:
        """The session ``worker`` holds, if the message carries its secret and came the
        way that session did (any peer of the same hub for the ack channel)."""
        s = self.workers.get(worker)
        if s is None or not secret or not secrets.compare_digest(secret, s.secret):
            return None
        if s.origin.hub != origin.hub:
            return None
        if origin.peer is not None and origin != s.origin:
            return None
        return s

    # --- hello, claim, welcome -------------------------------------------------------

    def _on_hello(
        self,
        hello: Hello,
        origin: Origin,
        now: float,
        reserved: Mapping[int, frozenset[int]],
        credential: str | None = None,
    ) -> list[Effect]:
        if hello.worker == AUTO_WORKER:
            held = self._by_origin.get(origin)
            worker = held if held is not None else self.free_worker_id(reserved)
        else:
            worker = hello.worker
            other = next(
                (h for h, ids in reserved.items() if h != origin.hub and worker in ids), None
            )
            if other is not None:
                return self._refuse_claim(
                    origin, worker, f"a {self.transports[other]} worker holds that index"
                )

        effects: list[Effect] = []
        s = self.workers.get(worker)
        if s is not None and s.origin == origin and s.left is None and hello.attempt == s.attempt:
            # A repeat of a Hello already handled (a worker asks again until welcomed;
            # over Ray several may arrive at once, late): its Welcome again, and nothing
            # rewound (what the worker acked since, the repair interval).
            s.last_seen = now
            return self._welcome(s)
        if s is not None and s.origin != origin:
            if self.live(s, now):
                where = f"{s.transport}, pid {s.pid or '?'} on {s.host or '?'}"
                return self._refuse_claim(origin, worker, f"a live worker holds it ({where})")
            effects.append(Forget(s.origin))  # taken over: its secret means nothing now
        if s is not None:
            self._drop(s)
        previous = self._by_origin.get(origin)
        if previous is not None and previous in self.workers:
            self._drop(self.workers[previous])  # one connection speaks for one worker
        if len(self.workers) >= self.max_sessions:
            effects += self.expire(now)
            if len(self.workers) >= self.max_sessions:
                # Whatever this connection held before is dropped above: no one's now.
                effects.append(Forget(origin))
                return effects + self._refuse(
                    origin, "fleet-full", f"this sender keeps at most {self.max_sessions} workers"
                )
        s = Session(
            worker,
            origin,
            self.transports[origin.hub],
            secret=secrets.token_hex(16),
            attempt=hello.attempt,
            first_seen=now,
            last_seen=now,
            pid=hello.pid,
            host=hello.host,
            version=hello.version if hello.epoch == self.epoch else 0,
            epoch=hello.epoch if hello.epoch == self.epoch else 0,
            joining_to=self.version,
            may_relay=credential is None or credential.startswith(RELAY_CREDENTIAL),
        )
        self.workers[worker] = s
        self._by_origin[origin] = worker
        self._unclaim_worker(worker)  # it speaks for itself now: no relay speaks for it
        return effects + self._welcome(s)

    def _refuse_claim(self, origin: Origin, worker: int, why: str) -> list[Effect]:
        self.counters["refused_claims"] += 1
        return self._refuse(
            origin,
            "duplicate-worker",
            f"worker id {worker} is already taken: {why}; worker ids must be unique in a fleet",
        )

    def _welcome(self, s: Session) -> list[Effect]:
        """Admit the session's connection at its hub (before its Welcome, so what the hub
        offers its peers arrives first), and welcome it."""
        announced = self.announced[s.origin.hub]
        welcome = Reply(
            s.origin,
            Welcome(
                self.model_id,
                self.version,
                self.epoch,
                mode=self.mode,
                strategy=self.strategy,
                data_endpoint=str(announced.get("data_endpoint", "")),
                ack_endpoint=str(announced.get("ack_endpoint", "")),
                heartbeat_seconds=self.heartbeat,
                worker=s.worker,
                session=s.secret,
                attempt=s.attempt,
                ranks=self.ranks,
            ),
        )
        return [Admit(s.origin), welcome]

    def free_worker_id(self, reserved: Mapping[int, frozenset[int]] | None = None) -> int:
        """The lowest id no session holds and no hub reserves: what a worker that asks
        for an id gets. A holder that stopped answering keeps its id until its session
        expires; one that said goodbye gives it back at once."""
        taken = {w for w, s in self.workers.items() if s.left is None}
        taken |= self.claims.keys()
        for ids in (reserved or {}).values():
            taken |= ids
        return next(i for i in itertools.count() if i not in taken)

    # --- acks ------------------------------------------------------------------------

    def _on_ack(self, ack: Ack, origin: Origin, now: float) -> list[Effect]:
        s = self._authenticate(ack.worker, ack.session, origin)
        if s is None:
            self.counters["forged"] += 1
            self.reject(f"ack for worker {ack.worker} without its session (stale or forged)")
            return []
        if ack.epoch == self.epoch and ack.version > self.version:
            self.counters["forged"] += 1
            self.reject(
                f"worker {ack.worker} acked version {ack.version}; the latest is {self.version}",
                ack.worker,
            )
            return []
        s.last_seen = now
        s.pid, s.host = ack.pid or s.pid, ack.host or s.host
        s.received_bytes = ack.received_bytes
        s.rejected_frames = max(s.rejected_frames, ack.rejected_frames)
        if ack.applied:
            s.torn = False  # it holds a whole version again
        if ack.epoch == self.epoch and ack.applied:
            s.version = max(s.version, ack.version)
            if s.version >= s.joining_to:
                s.joining_to = 0
            s.epoch = ack.epoch
            s.last_ack = now
        if not ack.applied:
            s.rejections.append(ack.reason[:REASON_CHARS])
            s.refused = (ack.epoch, ack.version)
        p = self.pending
        if p is not None and ack.worker in p.targets and ack.epoch == self.epoch:
            if ack.applied and ack.version >= p.version:
                if ack.worker not in p.acked:
                    s.last_latency = now - p.started
                p.acked.add(ack.worker)
                p.rejected.pop(ack.worker, None)
            elif not ack.applied and ack.version == p.version:
                p.rejected[ack.worker] = ack.reason
        return []

    # --- requests --------------------------------------------------------------------

    def _on_snapshot_request(
        self, request: SnapshotRequest, s: Session, now: float
    ) -> list[Effect]:
        # Holding nothing of this sender's life, or less than the latest when it joined,
        # or nothing whole (torn).
        fresh = request.epoch != self.epoch or request.version < s.joining_to or request.torn
        behind = fresh or request.version < self.version
        # A worker left out of a targeted send stays behind (worker_ids means exactly
        # those workers); one that is joining gets the latest version.
        meant = fresh or max(s.target_version, self.broadcast_version) >= self.version
        s.torn = request.torn
        s.waiting = (request.gathering, request.waiting)
        if request.below or s.below:
            self._claim(s, parse_below(request.below), now)
        if request.epoch == self.epoch:
            s.version = max(s.version, min(request.version, self.version))
        refused = s.refused == (self.epoch, self.version)
        # A delta it cannot apply: the whole version now (not after repair_after), once.
        whole = request.whole and s.asked_whole != self.version
        if whole:
            s.asked_whole = self.version
        # A sharded learner's worker that gathers the latest version, this rank's part of
        # it in: it waits for other ranks' parts, and this one's again would not help.
        part_in = (
            self.part is not None
            and request.epoch == self.epoch
            and request.gathering == self.version
            and self.part not in request.waiting
            and not request.torn
        )
        if behind and meant and not refused and self.published:
            if part_in and not whole:
                return [Reply(s.origin, UpToDate(self.model_id, self.version, self.epoch, True))]
            if whole or now - s.last_repair >= self.repair_after:
                s.last_repair = now
                up_to_date = UpToDate(self.model_id, self.version, self.epoch, False)
                return [SendLatest(s.origin, up_to_date)]
            # Sent to it within repair_after: on its way.
            return [Reply(s.origin, UpToDate(self.model_id, self.version, self.epoch, True))]
        return [Reply(s.origin, UpToDate(self.model_id, self.version, self.epoch, False))]

    def _on_reading(self, note: Reading, s: Session, now: float) -> list[Effect]:
        """A worker reads a version's chunks slowly (or says its pace is back): kept for
        the window (:meth:`reading`), never answered. A note of another life of this
        sender says nothing of what it reads now."""
        if note.epoch != self.epoch or s.read_doubted:
            return []
        s.read, s.read_gap = (note.version, note.index), min(max(note.gap, 0.0), READ_GAP_MAX)
        s.read_at = now
        return []

    def repair_turned_down(self, origin: Origin, now: float) -> None:
        """The sender did not send the latest version that a SendLatest for the worker
        at ``origin`` asked for at ``now`` (its last chunks were still queued for that
        worker, or too many repairs streamed). That repair counts for REPAIR_RETRY at
        most: a worker still behind by then is served at its next ask, not a whole
        ``repair_after`` later (which a fleet may set to a minute)."""
        worker = self._by_origin.get(origin)
        s = None if worker is None else self.workers.get(worker)
        if s is not None:
            s.last_repair = min(s.last_repair, now - self.repair_after + REPAIR_RETRY)

    # --- relays' claims ----------------------------------------------------------------

    def _claim(self, relay: Session, below: dict[int, int], now: float) -> None:
        """Take a relay's word for the workers behind it where nobody else speaks for
        them: a worker held live by another session (its own, or a live relay's) cannot
        be claimed until it is gone, and all claims together stay within MAX_CLAIMS.
        What it no longer names, it no longer holds."""
        kept: dict[int, int] = {}
        refused = 0
        if not relay.may_relay:
            # Its hub authenticated it, as a client that is not a relay: it speaks for
            # nobody but itself.
            refused, below = len(below), {}
        for w, version in below.items():
            holder = self.claims.get(w)
            direct = self.workers.get(w)
            if (
                (direct is not None and direct.origin != relay.origin and self.live(direct, now))
                or (holder is not None and holder != relay.worker and self._live_id(holder, now))
                or (holder is None and len(self.claims) >= MAX_CLAIMS)
            ):
                refused += 1
                continue
            if holder is not None and holder != relay.worker:
                self.workers[holder].below.pop(w, None)  # a silent relay's: taken over
            self.claims[w] = relay.worker
            kept[w] = version
        for w in relay.below.keys() - kept.keys():
            if self.claims.get(w) == relay.worker:
                del self.claims[w]
        relay.below = kept
        if refused:
            self.counters["refused_claims"] += refused
            why = (
                "that another session holds (or past the fleet's limit on claims)"
                if relay.may_relay
                else "below it, but its key is not allowed to act as a relay"
            )
            self.reject(
                f"worker {relay.worker} named {refused} worker(s) {why}: ignored", relay.worker
            )

    def _unclaim_worker(self, worker: int) -> None:
        holder = self.workers.get(self.claims.pop(worker, -1))
        if holder is not None:
            holder.below.pop(worker, None)

    def _unclaim(self, relay: Session) -> None:
        for w in relay.below:
            if self.claims.get(w) == relay.worker:
                del self.claims[w]
        relay.below = {}

    def _on_probe(self, request: ProbeRequest, s: Session, now: float) -> list[Effect]:
        if now - s.last_probe < PROBE_INTERVAL:
            self.counters["probes_limited"] += 1
            return []
        s.last_probe = now
        return [FanOut(s.origin.hub, Probe(self.model_id, s.worker, request.nonce[:64]))]

    def _on_goodbye(self, s: Session, now: float) -> list[Effect]:
        if s.left is not None:
            self.counters["stray_goodbyes"] += 1
            return []
        s.left = now
        self._unclaim(s)
        self.counters["goodbyes"] += 1
        if self._by_origin.get(s.origin) == s.worker:
            del self._by_origin[s.origin]
        p = self.pending
        if p is not None and p.dynamic and s.worker in p.targets:
            p.targets = p.targets - {s.worker}  # "every live worker" no longer includes it
            p.acked.discard(s.worker)
            p.rejected.pop(s.worker, None)
        return [Forget(s.origin)]
