"""In-process ranks of a sharded learner over real ZeroMQ sockets (tcp on 127.0.0.1),
for the tests of what a rank reports: its status rows and its metrics."""

from __future__ import annotations

import threading
from typing import Any

import torch
from _sharded_fixtures import RowsPart


class ShardedFleet:
    """Three ranks of a learner, each a sender of its part over tcp on 127.0.0.1 (real
    ROUTER sockets), and two workers given rank 0's endpoint alone."""

    def __init__(self, ranks: int = 3, timeout: float = 20.0) -> None:
        from zmqsync import WeightReceiver, WeightSender
        from zmqsync.transport.zmq_router import RouterHub, RouterSpoke

        torch.manual_seed(0)
        self.model = {"w": torch.randn(7, 3), "b": torch.randn(4)}
        hubs = [RouterHub("tcp://127.0.0.1:*", insecure=True) for _ in range(ranks)]
        self.endpoints = [str(h.endpoint) for h in hubs]
        self.senders = [
            WeightSender(
                hub,
                model=self.model,
                strategy="state_dict",
                num_workers=2,
                timeout=timeout,
                epoch=11,  # the ranks agree on one (a scheme makes them)
                part=RowsPart(r, ranks),  # type: ignore[arg-type]
                ranks=self.endpoints,
            )
            for r, hub in enumerate(hubs)
        ]
        self.receivers = [
            WeightReceiver(
                RouterSpoke(self.endpoints[0]),
                model={k: torch.zeros_like(t) for k, t in self.model.items()},
                strategy="state_dict",
                worker_idx=i,
                timeout=20,
                connect_rank=RouterSpoke,
            )
            for i in range(2)
        ]
        for r in self.receivers:
            r.connect()
            r.start()

    def send(self, ranks: list[int] | None = None) -> list[BaseException]:
        """A new version sent by ``ranks`` (default: all) at once; what they raised."""
        with torch.no_grad():
            self.model["w"].add_(1.0)
        threads, errors = self.start_send(ranks)
        for t in threads:
            t.join(60)
        return errors

    def start_send(
        self, ranks: list[int] | None = None
    ) -> tuple[list[threading.Thread], list[BaseException]]:
        errors: list[BaseException] = []

        def one(sender: Any) -> None:
            try:
                sender.send()
            except BaseException as exc:
                errors.append(exc)

        chosen = range(len(self.senders)) if ranks is None else ranks
        threads = [threading.Thread(target=one, args=(self.senders[r],)) for r in chosen]
        for t in threads:
            t.start()
        return threads, errors

    def close(self) -> None:
        for r in self.receivers:
            r.close()
        for s in self.senders:
            s.close()
