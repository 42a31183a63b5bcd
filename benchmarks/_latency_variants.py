"""The sync-latency benchmark's variants, each set up for one cell: the hand-written pyzmq
baseline, and zmqsync's ZeroMQ scheme with or without its retained snapshot.

Each opens the learner's end in this process and one session in each of its worker
processes (see :mod:`benchmarks._latency_worker`), then sends the learner's model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from benchmarks._baseline import BaselineLearner
from benchmarks._pool import OPEN_MARGIN_SECONDS, WorkerPool
from zmqsync import ZMQWeightSyncScheme
from zmqsync.transport.base import counters

StateDict = dict[str, torch.Tensor]


class Variant:
    """One way of syncing (baseline or zmqsync) set up for one cell."""

    name: str
    timeout: float

    def open(self, pool: WorkerPool, procs: Sequence[int], size: str, model: StateDict) -> None:
        """Set up the learner's end and one worker session in each of the pool's
        processes ``procs`` (worker ids 0..K-1, in that order)."""
        raise NotImplementedError

    def send(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def shared_bytes(self) -> int:
        """Shared memory the learner maps for its sends (not malloc'd, so the meter
        misses it; charged to the variant's extra memory)."""
        return 0


class BaselineVariant(Variant):
    """The hand-written pyzmq baseline (:mod:`benchmarks._baseline`)."""

    def __init__(self, mode: str, transport: str, workdir: str, tag: str, timeout: float) -> None:
        self.name = "baseline"
        self.mode, self.transport, self.workdir, self.tag = mode, transport, workdir, tag
        self.timeout = timeout
        self.learner: BaselineLearner | None = None

    def open(self, pool: WorkerPool, procs: Sequence[int], size: str, model: StateDict) -> None:
        self.model, self.workers = model, len(procs)
        self.learner = BaselineLearner(self.mode, self.transport, self.workdir, self.tag)
        ep = (self.learner.data_endpoint, self.learner.ack_endpoint)
        pool.call(
            procs,
            "open_baseline",
            {p: (self.name, self.mode, *ep, size, i) for i, p in enumerate(procs)},
            self.timeout,
        )
        self.learner.handshake(self.workers, self.timeout)

    def send(self) -> None:
        assert self.learner is not None
        self.learner.send(self.model, self.workers, self.timeout)

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
            self.learner = None


class ZmqsyncVariant(Variant):
    """``ZMQWeightSyncScheme("state_dict", ...)``, with or without the retained snapshot."""

    def __init__(
        self,
        mode: str,
        transport: str,
        workdir: str,
        tag: str,
        timeout: float,
        *,
        retain_snapshot: bool,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = "zmqsync" if retain_snapshot else "zmqsync-noretain"
        self.mode = mode
        self.endpoint = (
            "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{workdir}/{tag}-{self.name}"
        )
        self.timeout = timeout
        self.retain_snapshot = retain_snapshot
        #: The scheme's other keywords (``pack_threshold``, ``chunk_bytes``).
        self.options = dict(options or {})
        self.scheme: ZMQWeightSyncScheme | None = None

    def open(self, pool: WorkerPool, procs: Sequence[int], size: str, model: StateDict) -> None:
        self.scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode=self.mode,  # type: ignore[arg-type]
            endpoint=self.endpoint,
            timeout=self.timeout,
            retain_snapshot=self.retain_snapshot,
            **self.options,
        )
        self.scheme.init_on_sender("policy", model=model, num_workers=len(procs))
        # The scheme pickles into the workers with its bound endpoint (not its sockets).
        pool.call(
            procs,
            "open_zmqsync",
            {p: (self.name, self.scheme, size, i, self.timeout) for i, p in enumerate(procs)},
            self.timeout + OPEN_MARGIN_SECONDS,
        )

    def send(self) -> None:
        assert self.scheme is not None
        self.scheme.send()

    def shared_bytes(self) -> int:
        assert self.scheme is not None
        return int(counters(self.scheme.get_sender().transport).get("shm_bytes", 0))

    def close(self) -> None:
        if self.scheme is not None:
            self.scheme.shutdown()
            self.scheme = None
