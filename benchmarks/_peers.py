"""Peers of the transports benchmark (issue 3) that are neither zmqsync nor torchrl: one
flat buffer per version, through Ray's object store (``ray-store``) or a
``torch.distributed`` gloo broadcast (``gloo-flat``).

Both move a model as one flat byte buffer: the learner packs its tensors into it (one
``torch._foreach_copy_`` over views made once), and each worker copies it back out into
tensors of its own (another ``_foreach_copy_``). :class:`FlatLayout` is that packing.

gloo-flat, per send (:meth:`GlooLearner.send`, timed as a whole): the learner writes a
sequence number into the buffer's first 8 bytes and packs the tensors after it, posts
one 8-byte receive per worker, broadcasts the buffer, and waits for every worker's
receive. Each worker (:class:`GlooWorker`, a thread of its own) receives the broadcast
into its preallocated buffer, copies it into its tensors, and sends the sequence number
back to rank 0 (point to point: the cheapest "done" gloo has, one 8-byte message per
worker straight to the learner, no collective). The learner checks every number.

Everything listens on and connects to 127.0.0.1 only: the rendezvous store on a socket
bound there (``TCPStore`` would otherwise listen on every interface), the gloo device on
``127.0.0.1``. Every wait has a deadline; a gloo wait that times out closes its pairs, so
a worker's idle wait for the next broadcast has a long one (:data:`GLOO_IDLE_SECONDS`)
and ends at once, with an error, when the learner closes its group.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Sequence
from typing import Any, Final

import torch
import torch.distributed as dist

#: The only address anything here binds to or connects to.
LOOPBACK: Final = "127.0.0.1"
#: How long a gloo-flat worker waits for the next broadcast. It idles while the other
#: variants' blocks run (seconds to minutes); a timeout would break its group, so this
#: is long. The worker's wait ends sooner when the learner closes the group, or with
#: the process.
GLOO_IDLE_SECONDS: Final = 3600.0
#: Tag of the workers' "done" messages.
ACK_TAG: Final = 7
#: Bytes before the tensors in a gloo-flat buffer: the version's sequence number.
HEADER_BYTES: Final = 8


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class FlatLayout:
    """Tensors laid back to back in one flat ``uint8`` buffer, and the copies in and out.

    The byte views of the tensors are made once; :meth:`split` makes those of a buffer
    (once per buffer for a buffer that is reused; per version for a new one).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("FlatLayout needs contiguous tensors")
        self.byte_views = [t.detach().view(-1).view(torch.uint8) for t in tensors]
        self.sizes = [v.numel() for v in self.byte_views]
        self.nbytes = sum(self.sizes)

    def split(self, flat: torch.Tensor, offset: int = 0) -> list[torch.Tensor]:
        """Views of ``flat`` (``uint8``, from ``offset``), one per tensor, in order."""
        return list(flat[offset : offset + self.nbytes].split(self.sizes))

    def pack(self, views: list[torch.Tensor]) -> None:
        """Copy the tensors into the buffer whose :meth:`split` gave ``views``."""
        torch._foreach_copy_(views, self.byte_views)

    def unpack(self, views: list[torch.Tensor]) -> None:
        """Copy the buffer whose :meth:`split` gave ``views`` into the tensors."""
        torch._foreach_copy_(self.byte_views, views)


def _group(store: Any, rank: int, world: int, timeout: float) -> Any:
    """A gloo process group on the loopback device; its rendezvous waits ``timeout``."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    options._timeout = _seconds(timeout)
    return dist.ProcessGroupGloo(store, rank, world, options)


class GlooLearner:
    """Rank 0 of a gloo-flat group of ``workers + 1``: packs and broadcasts each version.

    Construct it (the store starts listening), have the workers join on :attr:`port`,
    and call :meth:`join` at the same time (it returns when every rank has joined).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], workers: int, timeout: float) -> None:
        self.layout = FlatLayout(tensors)
        self.workers = workers
        self.timeout = timeout
        self.flat = torch.empty(HEADER_BYTES + self.layout.nbytes, dtype=torch.uint8)
        self._views = self.layout.split(self.flat, HEADER_BYTES)
        self._seq = self.flat[:HEADER_BYTES].view(torch.int64)
        self._acks = [torch.zeros(1, dtype=torch.int64) for _ in range(workers)]
        self.sent = 0
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((LOOPBACK, 0))
            listener.listen(64)
            self.port: int = listener.getsockname()[1]
        except BaseException:
            listener.close()
            raise
        # The store owns the socket from here on (and closes it).
        self._store: Any = dist.TCPStore(
            LOOPBACK,
            self.port,
            world_size=None,
            is_master=True,
            timeout=_seconds(timeout),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        self._pg: Any = None

    def join(self) -> None:
        self._pg = _group(self._store, 0, self.workers + 1, self.timeout)

    def send(self) -> None:
        pg = self._pg
        if pg is None:
            raise RuntimeError("gloo-flat: the group is not joined (or was closed)")
        self.sent += 1
        self._seq.fill_(self.sent)
        self.layout.pack(self._views)
        # Posted first, so that each worker's "done" lands as soon as it is sent.
        done = [pg.recv([ack], rank + 1, ACK_TAG) for rank, ack in enumerate(self._acks)]
        pg.broadcast(self.flat, 0, timeout=_seconds(self.timeout)).wait()
        for work in done:
            work.wait()  # the group's timeout
        wrong = [i for i, ack in enumerate(self._acks) if int(ack) != self.sent]
        if wrong:
            raise RuntimeError(
                f"gloo-flat: workers {wrong} acked {[int(self._acks[i]) for i in wrong]}, "
                f"not version {self.sent}"
            )

    def close(self) -> None:
        """Leave the group: the workers' pending receives fail at once, ending them."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
        self._store = None


class GlooWorker:
    """Rank ``rank`` of a gloo-flat group: receives each version and copies it into
    ``tensors`` (its own), on a thread of its own, then tells rank 0."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        port: int,
        rank: int,
        world: int,
        timeout: float,
    ) -> None:
        self.tensors = tensors
        self.layout = FlatLayout(list(tensors.values()))
        self.flat = torch.empty(HEADER_BYTES + self.layout.nbytes, dtype=torch.uint8)
        self._views = self.layout.split(self.flat, HEADER_BYTES)
        self._seq = self.flat[:HEADER_BYTES].view(torch.int64)
        self._ack = torch.zeros(1, dtype=torch.int64)
        self.lock = threading.Lock()  # held while the tensors are written
        self.applied = 0
        self.error: str | None = None
        self._closing = threading.Event()
        store = dist.TCPStore(
            LOOPBACK, port, world_size=None, is_master=False, timeout=_seconds(timeout)
        )
        pg = _group(store, rank, world, timeout)
        # The thread holds the only reference to the group: it is destroyed there, once
        # no wait is pending on it.
        self._thread = threading.Thread(
            target=self._run, args=(pg,), name=f"gloo-flat-{rank}", daemon=True
        )
        self._thread.start()

    def _run(self, pg: Any) -> None:
        idle = _seconds(GLOO_IDLE_SECONDS)
        try:
            while not self._closing.is_set():
                pg.broadcast(self.flat, 0, timeout=idle).wait()
                with self.lock:
                    self.layout.unpack(self._views)
                    self.applied += 1
                self._ack.copy_(self._seq)
                pg.send([self._ack], 0, ACK_TAG).wait()
        except Exception as exc:  # the learner closed the group, or it broke
            if not self._closing.is_set():
                self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Stop after the pending receive, which ends when the learner leaves."""
        self._closing.set()
