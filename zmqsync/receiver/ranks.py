"""A worker of a sharded learner: a session with each of its ranks, and the gather of
their parts of each version into one whole version.

Rank 0's Welcome names every rank's endpoint; the worker says hello to each, proves
each fan-out with a probe, and asks each for its latest part. Every part of a version
is gathered (:class:`~zmqsync.chunking.parts.PartGather`) before the whole version goes
to the apply machinery, and its ack goes to every rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from zmqsync.chunking.parts import PartGather, Place
from zmqsync.receiver.observer import ReceiverObserver
from zmqsync.receiver.rejections import Rejections
from zmqsync.receiver.session import SessionHost, UpstreamSession
from zmqsync.transport.base import SpokeTransport

__all__ = ["RankSessions"]

log = logging.getLogger("zmqsync.receiver")


class RankSessions:
    """The sessions with every rank of a sharded learner (rank 0's is ``first``, the
    receiver's own; the others are made here, each over a spoke of its own) and the
    gather of their parts.

    It owns the other ranks' sessions (and closes them) and the gather; ``first``
    stays its holder's.
    """

    def __init__(
        self,
        host: SessionHost,
        first: UpstreamSession,
        endpoints: Sequence[str],
        connect_rank: Callable[[str], SpokeTransport],
        *,
        gap: float,
        place: Place | None = None,
        stats: dict[str, Any],
        rejections: Rejections,
        observer: ReceiverObserver,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.sessions: list[UpstreamSession] = [first]
        try:
            for endpoint in self.endpoints[1:]:
                session = UpstreamSession(
                    host,
                    connect_rank(endpoint),
                    model_id=first.model_id,
                    strategy=first.strategy,
                    worker_idx=first.worker_idx,
                    failover=(),
                    stats=stats,
                    rejections=rejections,
                    observer=observer,
                )
                session.slices = first.slices  # every rank cuts its part for them
                session.new_attempt()
                self.sessions.append(session)
        except BaseException:
            self.close()
            raise
        self.gather = PartGather(len(self.endpoints), gap, place)

    @property
    def others(self) -> list[UpstreamSession]:
        """The sessions with ranks 1.. (rank 0's is the holder's own)."""
        return self.sessions[1:]

    def welcomed(self) -> bool:
        return all(s.welcomed for s in self.sessions)

    def probed(self) -> bool:
        return all(s.probe_ok for s in self.sessions)

    def caught_up(self) -> bool:
        return all(s.caught_up for s in self.sessions)

    def tell_waiting(self) -> None:
        """Let every session's next heartbeat say which parts of the version under way
        are still missing: a rank whose send waits then knows which ranks to name."""
        waiting = self.gather.waiting()
        for s in self.sessions:
            s.waiting = waiting

    def say_hello(self) -> None:
        """Say hello to the ranks that have not welcomed this worker yet."""
        for s in self.others:
            if not s.welcomed:
                s.send_hello()

    def start_probes(self) -> None:
        for s in self.others:
            s.start_probe()

    def send_probes(self) -> None:
        for s in self.sessions:
            if not s.probe_ok:
                s.send_probe()

    def request_snapshots(self) -> None:
        for s in self.sessions:
            if not s.caught_up:
                s.request_snapshot()

    def close(self) -> None:
        """Say goodbye to the other ranks and close their spokes (never waits on one)."""
        for s in self.sessions[1:]:
            s.say_goodbye()
            with contextlib.suppress(Exception):
                s.spoke.close()
