"""How a fleet starts a version: whom a send waits for, the peers it goes to, and
which version each of them holds whole (what a delta may be against)."""

from __future__ import annotations

from collections.abc import Iterable

from zmqsync.fleet.records import Send
from zmqsync.fleet.views import FleetViews
from zmqsync.transport.base import PeerId

__all__ = ["FleetSends"]


class FleetSends(FleetViews):
    """The part of :class:`~zmqsync.fleet.Fleet` that begins sends (and forwards)."""

    pending: Send | None
    broadcast_version: int

    def targets(self, worker_ids: int | Iterable[int] | None, now: float) -> frozenset[int]:
        """The workers a send to ``worker_ids`` waits for (checked)."""
        if worker_ids is None:
            if self.num_workers is not None:
                return frozenset(range(self.num_workers))
            return frozenset(w for w, s in self.workers.items() if self.live(s, now))
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        for w in ids:
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise ValueError(f"worker_ids must be non-negative ints; got {w!r}")
        behind = self._behind_relays(ids, now)
        for w in ids:
            if self.num_workers is not None and w >= self.num_workers and w not in behind:
                raise ValueError(
                    f"worker {w} does not exist: this sender has workers 0..{self.num_workers - 1}"
                )
        return frozenset(ids)

    def _behind_relays(self, ids: Iterable[int], now: float) -> dict[int, int]:
        """Of ``ids``, those that are no session of this sender's but a live relay's
        worker (its claim stands), with that relay's id. A route through a relay that
        went quiet is not taken: its workers, failed over below another relay, are
        claimed by that one at its next heartbeat."""
        out: dict[int, int] = {}
        for w in ids:
            s = self.workers.get(w)
            if s is not None and s.left is None:
                continue
            relay = self.relay_of(w, now)
            if relay is not None:
                out[w] = relay.worker
        return out

    def begin_send(
        self, worker_ids: int | Iterable[int] | None, now: float, timeout: float
    ) -> tuple[Send, dict[int, list[PeerId]]]:
        """Start the next version: returns it, and per hub the peers an addressed send
        (``worker_ids`` given) goes to; a worker behind a relay is reached through it
        (``Send.routes``)."""
        ids = self.targets(worker_ids, now)
        return self._begin(self.version + 1, ids, worker_ids, now, timeout)

    def begin_forward(
        self,
        version: int,
        epoch: int,
        now: float,
        timeout: float,
        worker_ids: Iterable[int] | None = None,
        *,
        again: bool = False,
    ) -> Send:
        """A relay starts sending on ``version`` of ``epoch`` (its upstream's numbering,
        which a new epoch starts again) to every worker, or to ``worker_ids`` (those of
        them it knows: its own and those behind its relays). ``again``: the version it
        already sent, fetched anew for workers that lack it."""
        if epoch != self.epoch:
            # What workers held of the old life is void; its version 0 may come now.
            self.epoch, self.version, self.published = epoch, 0, False
        if version < self.version or (version == self.version and self.published and not again):
            raise ValueError(f"version {version} forwarded after {self.version}")
        if worker_ids is None:
            ids = self.targets(None, now)
        else:
            wanted = list(worker_ids)
            behind = self._behind_relays(wanted, now)
            ids = frozenset(w for w in wanted if w in self.workers or w in behind)
        send, _ = self._begin(version, ids, worker_ids, now, timeout)
        return send

    def restart_forward(self, version: int, epoch: int, now: float) -> Send | None:
        """The send of the version a relay is forwarding, if ``version`` of ``epoch`` is
        that version, streamed again from its first chunk by its upstream (a repair that
        came while the first stream was still on its way, or after it broke); None
        otherwise. The send goes on: the same workers, what they answered still counts,
        and those it still waits for are streamed the version anew now (so none of them
        is sent a repair meanwhile)."""
        p = self.pending
        if p is None or not self.published or (version, epoch) != (self.version, self.epoch):
            return None
        if p.version != version:
            return None
        for w in p.missing:
            s = self.workers.get(w)
            if s is not None:
                s.last_repair = now
        return p

    def settled(self, version: int, epoch: int, forward: Send | None, now: float) -> bool:
        """For a relay: whether every worker its ack of ``version`` (of its upstream's
        ``epoch``) waits for holds it: those ``forward`` (the send of its forward in
        progress, if of that version) was for, else every live one."""
        if forward is not None and forward.version == version and self.epoch == epoch:
            return forward.done
        if self.epoch != epoch:
            return not self.targets(None, now)
        for w in self.targets(None, now):
            s = self.workers.get(w)
            if s is None or s.epoch != self.epoch or s.version < version:
                return False
        return True

    def refusals(self, version: int, forward: Send | None, relay: int | None) -> str:
        """For relay ``relay``'s ack of ``version`` upstream: why workers below refused it
        (those ``forward``, the send of its forward in progress, went to), in one line,
        each named; empty when none did."""
        if forward is None or forward.version != version:
            return ""
        return "; ".join(
            f"worker {w} (behind relay {relay}) refused it: {reason}"
            for w, reason in sorted(forward.rejected.items())
        )

    def _begin(
        self,
        version: int,
        targets: frozenset[int],
        worker_ids: int | Iterable[int] | None,
        now: float,
        timeout: float,
    ) -> tuple[Send, dict[int, list[PeerId]]]:
        self.version = version
        self.published = True
        routes: dict[int, list[int]] = {}
        if worker_ids is not None:
            for w, relay in self._behind_relays(targets, now).items():
                routes.setdefault(relay, []).append(w)
            targets = (targets - {w for ws in routes.values() for w in ws}) | routes.keys()
        send = Send(
            self.version,
            targets,
            now,
            now + timeout,
            dynamic=worker_ids is None and self.num_workers is None,
            routes={r: tuple(sorted(ws)) for r, ws in routes.items()},
        )
        self.pending = send
        if worker_ids is None:
            self.broadcast_version = self.version
        peers: dict[int, list[PeerId]] = {}
        for w in targets:
            s = self.workers.get(w)
            if s is None:
                continue
            s.last_repair = now
            s.target_version = self.version
            if s.origin.peer is not None and s.left is None:
                peers.setdefault(s.origin.hub, []).append(s.origin.peer)
        return send, peers

    def holdings(self, targets: Iterable[int]) -> dict[int, list[tuple[PeerId, int | None]]]:
        """Per hub, each of ``targets``' peers and the version of this sender's life it
        holds whole (None: nothing known to be whole), which a delta may be against."""
        out: dict[int, list[tuple[PeerId, int | None]]] = {}
        for w in targets:
            s = self.workers.get(w)
            if s is None or s.left is not None or s.origin.peer is None:
                continue
            known = s.epoch == self.epoch and not s.torn and s.version < self.version
            out.setdefault(s.origin.hub, []).append((s.origin.peer, s.version if known else None))
        return out
