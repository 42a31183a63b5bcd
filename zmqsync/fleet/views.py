"""Read-only views of a fleet: who is live or gone, who may still read a version, the
rows of ``status()`` and the lines of error messages."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Final

from zmqsync.fleet.records import Origin, Session
from zmqsync.status_types import STATUS_BELOW, STATUS_ROWS, WorkerStatus
from zmqsync.transport.base import PeerId

__all__ = ["LIVE_HEARTBEATS", "STATUS_ROWS", "FleetViews"]

#: A worker heard from within this many heartbeats is live: a fleet that is whoever
#: connected waits for it, and no other connection may claim its id.
LIVE_HEARTBEATS: Final = 3


class FleetViews:
    """What :class:`~zmqsync.fleet.Fleet` answers without changing anything."""

    workers: dict[int, Session]
    claims: dict[int, int]
    num_workers: int | None
    heartbeat: float
    repair_after: float
    mode: str
    epoch: int
    version: int
    published: bool

    @property
    def _beat(self) -> float:
        return max(self.heartbeat, 0.1)

    def live(self, session: Session, now: float) -> bool:
        """Whether a worker counts as present: not gone, and heard from lately."""
        return session.left is None and now - session.last_seen < LIVE_HEARTBEATS * self._beat

    def _live_id(self, worker: int, now: float) -> bool:
        s = self.workers.get(worker)
        return s is not None and self.live(s, now)

    def relay_of(self, worker: int, now: float) -> Session | None:
        """The live relay whose claim on ``worker`` stands, if any."""
        relay = self.workers.get(self.claims.get(worker, -1))
        return relay if relay is not None and self.live(relay, now) else None

    def lacking(self, version: int) -> tuple[int, ...]:
        """Workers not gone that do not hold ``version`` of this epoch whole."""
        return tuple(
            w
            for w, s in self.workers.items()
            if s.left is None and (s.epoch != self.epoch or s.version < version or s.torn)
        )

    def below(self, limit: int) -> dict[str, int]:
        """For a relay's heartbeats: its workers not gone and the version each holds,
        with those behind its own relays (whose claims stand), at most ``limit``."""
        out: dict[str, int] = {}
        for w, s in self.workers.items():
            if s.left is not None:
                continue
            out[str(w)] = s.version if s.epoch == self.epoch else 0
            out.update((str(b), v) for b, v in s.below.items())
            if len(out) >= limit:
                break
        return dict(list(out.items())[:limit])

    def gone(self, workers: Iterable[int], lost: Mapping[int, frozenset[PeerId]]) -> set[int]:
        """Those of ``workers`` that said goodbye, or whose hub says their peer is lost."""
        out = set()
        for w in workers:
            s = self.workers.get(w)
            if s is None:
                continue
            if s.left is not None or s.origin.peer in lost.get(s.origin.hub, frozenset()):
                out.add(w)
        return out

    def may_still_read(self, version: int, peers: Collection[PeerId] | None) -> bool:
        """Whether a worker that was sent ``version``'s chunks (those at ``peers``; None:
        every worker) may still be reading them: it neither applied nor refused that
        version (or a later one) and did not say goodbye. A worker whose transport
        lost it counts: a stopped process reads on once it is continued."""
        for s in self.workers.values():
            if s.left is not None or (peers is not None and s.origin.peer not in peers):
                continue
            if s.epoch == self.epoch and s.version >= version:
                continue
            if s.refused == (self.epoch, version):
                continue
            return True
        return False

    # --- status ----------------------------------------------------------------------

    def status_rows(
        self, now: float, copying: Mapping[Origin, int] | None = None
    ) -> tuple[list[WorkerStatus], dict[str, int]]:
        """Worker rows for ``status()`` (the furthest behind first, at most
        :data:`STATUS_ROWS`) and counts over the whole fleet. ``copying``: the peers
        their hubs send copies instead of shared memory, with the blocks each pins."""
        copying = copying or {}
        expected = set(range(self.num_workers)) if self.num_workers is not None else set()
        rows: list[WorkerStatus] = []
        for w in sorted(expected | self.workers.keys()):
            s = self.workers.get(w)
            if s is None:
                rows.append(WorkerStatus(w, expected=True, lag=self.version))
                continue
            version = s.version if s.epoch in (self.epoch, 0) else 0
            rows.append(
                WorkerStatus(
                    worker=w,
                    connected=True,
                    live=self.live(s, now),
                    left=s.left is not None,
                    since_left_s=None if s.left is None else now - s.left,
                    expected=w in expected,
                    transport=s.transport,
                    host=s.host,
                    pid=s.pid,
                    version=version,
                    lag=max(0, self.version - version),
                    since_last_ack_s=None if s.last_ack is None else now - s.last_ack,
                    since_last_seen_s=now - s.last_seen,
                    last_latency_s=s.last_latency,
                    received_bytes=s.received_bytes,
                    rejected_frames=s.rejected_frames,
                    rejections=list(s.rejections),
                    torn=s.torn,
                    repairing=s.torn and now - s.last_repair < self.repair_after,
                    below=self._below_shown(s) or None,
                    below_total=len(s.below),
                    shm_copies=True if s.origin in copying else None,
                    shm_pinned=copying.get(s.origin),
                )
            )
        counts = {
            "workers_total": len(rows),
            "workers_live": sum(1 for r in rows if r.live),
            "workers_shown": min(len(rows), STATUS_ROWS),
        }
        if len(rows) > STATUS_ROWS:
            # Keep the rows worth a look: furthest behind first, then by id.
            rows = sorted(rows, key=lambda r: (-r.lag, r.worker))[:STATUS_ROWS]
            rows.sort(key=lambda r: r.worker)
        return rows, counts

    def _below_shown(self, s: Session) -> dict[str, int]:
        """The workers behind a relay that a status row shows: at most STATUS_BELOW,
        the furthest behind first (``below_total`` counts them all)."""
        below = s.below
        if len(below) > STATUS_BELOW:
            shown = sorted(below.items(), key=lambda item: (item[1], item[0]))[:STATUS_BELOW]
            below = dict(shown)
        return {str(b): v for b, v in sorted(below.items())}

    def acked_versions(self, lost: Mapping[int, frozenset[PeerId]]) -> dict[int, int]:
        """The newest version each worker acked in this epoch (0: none yet), by worker
        id: every worker not gone (see :meth:`gone`; ``lost``: each hub's lost peers),
        and every expected one.

        A gone worker holds nothing the sender can count on: 0 if it is expected, else
        not listed. A silent one still holds what it acked as far as anyone knows, so it
        is listed until its session expires (whether it is live is :meth:`status_rows`'
        business).
        """
        expected = range(self.num_workers) if self.num_workers is not None else range(0)
        versions = dict.fromkeys(expected, 0)
        gone = self.gone(self.workers, lost)
        for w, s in self.workers.items():
            if w not in gone:
                versions[w] = s.version if s.epoch in (self.epoch, 0) else 0
        return dict(sorted(versions.items()))

    def current(self, lost: Mapping[int, frozenset[PeerId]]) -> frozenset[int]:
        """Workers not gone that hold the latest version of this epoch: they acked it
        (or said so in their hello). Nothing published: every worker not gone."""
        gone = self.gone(self.workers, lost)
        return frozenset(
            w
            for w, s in self.workers.items()
            if w not in gone
            and (not self.published or (s.epoch == self.epoch and s.version >= self.version))
        )

    def waiting_for(self, workers: Iterable[int], version: int) -> dict[int, tuple[int, ...]]:
        """For a sharded learner's rank: the parts (ranks) of ``version`` each of
        ``workers`` still waits for, as its last heartbeat said (those that said
        nothing of ``version`` are left out)."""
        out = {}
        for w in workers:
            s = self.workers.get(w)
            if s is not None and s.waiting[0] == version and s.waiting[1]:
                out[w] = s.waiting[1]
        return out

    def describe(self, workers: Iterable[int], now: float) -> dict[int, str]:
        """A line per worker for error messages: where it is and what it holds."""
        out = {}
        for w in workers:
            s = self.workers.get(w)
            out[w] = (
                f"worker {w} never connected"
                if s is None
                else f"worker {w} ({s.transport}, pid {s.pid or '?'}) holds version "
                f"{s.version}, last heard {now - s.last_seen:.1f}s ago"
            )
            if s is not None and s.below:
                behind = [(b, v) for b, v in sorted(s.below.items()) if v < self.version]
                shown = ", ".join(f"worker {b} holds {v}" for b, v in behind[:8])
                more = f" and {len(behind) - 8} more" if len(behind) > 8 else ""
                out[w] += (
                    f" (a relay for {len(s.below)} worker(s); behind it: {shown}{more})"
                    if behind
                    else f" (a relay for {len(s.below)} worker(s))"
                )
        return out

    def transport_of(self, worker: int) -> str:
        s = self.workers.get(worker)
        return s.transport if s is not None else self.mode
