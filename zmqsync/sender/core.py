"""WeightSender: versions one model's weights and gets them to workers, acked.

The I/O shell around the fleet core (:mod:`zmqsync.fleet`), which decides everything
about the workers; this carries its decisions out. It holds its parts, each with its
own state: the copies a version streams from (:class:`~.versions.VersionStore`), its
counts and latencies (:class:`~.stats.SendStats`) and a pump per hub
(:class:`~.pump.HubRunner`). Caller memory never reaches a transport: each chunk of a
version is copied into memory the sender owns while the one before it is sent, and
each hub's stream keeps a window of chunks in its transport, written again only once
every transport let go of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch

import zmqsync.sender.pump as pump
from zmqsync.chunking.layout import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, StreamLayout
from zmqsync.errors import FrameError, SyncTimeout, TransportError, WeightsRejected
from zmqsync.fleet import Admit, FanOut, Fleet, Forget, Origin, Reply, Send, SendLatest
from zmqsync.protocol import (
    MAX_CHUNK_BYTES,
    Chunk,
    ErrorMessage,
    Hello,
    Kind,
    StatusReply,
    StatusRequest,
    UpToDate,
    WeightsSchema,
    decode,
    encode,
    encode_metadata,
    peek_kind,
)
from zmqsync.sender.lent import Gathered, LentPlan, LentTarget, StillWriting
from zmqsync.sender.pump import HubRunner, InFlight, StallClock, sum_counters
from zmqsync.sender.slices import SlicedWorkers
from zmqsync.sender.stats import SendStats
from zmqsync.sender.transfers import Copy, Forwarded, Forwarding, Pending, Stamp, Transfer
from zmqsync.sender.versions import VersionStore
from zmqsync.status_types import STATUS_ROWS, SenderStatus
from zmqsync.tensors.dtensor import LocalPart
from zmqsync.tensors.flatten import DEFAULT_PACK_THRESHOLD
from zmqsync.tensors.views import dtype_name
from zmqsync.transport.base import (
    AdmitsPeers,
    Announces,
    ForgetsPeers,
    HubTransport,
    Incoming,
    Lends,
    PeerId,
    ZeroCopy,
    counters,
    lost_peers,
    reserved_workers,
)
from zmqsync.transport.shm.lent import LENT_MIN_BYTES
from zmqsync.vocabulary import Metadata, Strategy, WorkerIds

__all__ = ["ACCEPTED", "WeightSender", "new_epoch"]

log = logging.getLogger("zmqsync.sender")

#: What a worker may send to a sender; anything else is refused before it is decoded
#: (a weights message sent to a sender would otherwise be parsed and held for nothing).
ACCEPTED: Final = frozenset(
    {
        Kind.ACK,
        Kind.HELLO,
        Kind.SNAPSHOT_REQUEST,
        Kind.PROBE_REQUEST,
        Kind.GOODBYE,
        Kind.READING,
    }
)
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
#: How long a send that streamed from the model's own memory (share_params, a hub that
#: lends none) waits, once its workers acked, for the transport to let go of its chunks
#: (pyzmq drops them on its own thread, a moment after ZeroMQ wrote them out); still
#: held after that (a stopped worker's queue), the model's tensors move on.
LET_GO_SECONDS: Final = 0.05
#: How long a send waits for the workers that lent their tensors to take their locks
#: (say go) before it streams the version to those that did not.
LENT_GO_WAIT: Final = 0.5
#: How fast a lent version is taken to be written into one worker (bytes per second, a
#: memory copy on a small machine): the first worker to say go waits for the others at
#: most as long as its own write would take, so they are written together.
LENT_WRITE_BYTES_PER_SECOND: Final = 10e9
#: Workers' lent memories kept mapped as tensors, at most (one per worker is expected).
MAX_LENT_TARGETS: Final = 4096


def new_epoch() -> int:
    """A random, non-zero 63-bit id for one life of a sender."""
    return secrets.randbits(63) | 1


def _without(
    transfers: list[Transfer], everyone: list[PeerId], left_out: set[PeerId]
) -> list[Transfer]:
    """``transfers`` with the peers ``left_out`` taken out: a fan-out is then addressed
    to the others (``everyone`` but them)."""
    out = []
    for t in transfers:
        to = [p for p in (everyone if t.to is None else t.to) if p not in left_out]
        if to:
            out.append(Transfer(t.copy, to, t.spans, t.base, t.workers, t.targets))
    return out


def _let_go(copy: Copy) -> bool:
    """Whether every transport let go of ``copy``'s memory, waiting LET_GO_SECONDS."""
    deadline = time.monotonic() + LET_GO_SECONDS
    while not copy.lease.released:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


class _Pumps:
    """What the pumps ask of their sender (:class:`~.pump.PumpHost`): the sender's own
    handling, looked up on it at each call."""

    __slots__ = ("_sender",)

    def __init__(self, sender: WeightSender) -> None:
        self._sender = sender

    def housekeeping(self, runner: HubRunner) -> None:
        self._sender._housekeeping(runner)

    def handle(self, incoming: Incoming, runner: HubRunner) -> None:
        self._sender._handle(incoming, runner)

    def pump_failed(self, exc: BaseException) -> None:
        self._sender._pump_failed(exc)

    def forwarded_version(self) -> int | None:
        forwarding = self._sender._forwarding
        return None if forwarding is None else forwarding.copy.version

    def forward_starting(self, runner: HubRunner, peer: PeerId) -> bool:
        forwarding = self._sender._forwarding
        if forwarding is None or runner.index not in forwarding.starting:
            return False
        to = forwarding.starting.get(runner.index)
        return to is None or peer in to

    def reading(self, runner: HubRunner, chunk: InFlight, now: float) -> bool:
        return self._sender.fleet.reading(runner.index, chunk.to, chunk.read, chunk.sent_at, now)

    def read_stalled(self, runner: HubRunner, chunk: InFlight, quiet: bool) -> None:
        with self._sender._cond:
            self._sender.fleet.read_stalled(runner.index, chunk.to, chunk.read, quiet)


class WeightSender:
    """Sends weights for ONE model to workers, and knows where each worker stands.

    Usually built by a scheme (``scheme.init_on_sender(...)``), not by hand.

    Args:
        hub: the transport's sender end; the sender owns and closes it.
        model_id: which model this sender synchronizes.
        model: what ``send(weights=None)`` extracts weights from.
        strategy: ``"state_dict"`` or ``"tensordict"``.
        num_workers: workers ``0..num_workers-1`` that ``send()`` targets by default;
            ``None`` targets every live worker: connected, heard from within the last
            ``LIVE_HEARTBEATS`` heartbeats, and not gone (closed its receiver).
        timeout: seconds ``send()`` waits for acks before raising :class:`SyncTimeout`.
        retain_snapshot: keep the copy of the latest version for late joiners and
            repairs after its send (one model's worth of memory); without it the copy
            lives only while its send does, and a late joiner waits for the next send.
            Before the first send, the published version 0 is then read from the
            weights when a worker is served, not copied (see :meth:`publish`).
        heartbeat: seconds between workers' heartbeats (told to them in the Welcome).
        repair_after: a worker still behind this long after a version was sent to it
            gets it again, addressed.
        chunk_bytes: the most bytes one chunk of a version carries.
        checksums: every chunk carries a CRC-32 of its bytes, checked by the worker (it
            costs about two memory copies' time per byte on each side; transports
            already check what they carry, CURVE cryptographically).
        share_params: move the model's tensors into shared memory that workers on this
            host copy from directly, so a synchronous ``send()`` copies nothing itself
            (each worker copies the version once, as with torch's shared tensors). The
            tensors keep their identity (an optimizer holding them is unaffected). Over
            a hub that lends no memory (ZeroMQ over tcp) they move into one buffer of
            the sender's own, which chunks are sent from without a copy. It needs one
            hub and a model of contiguous CPU tensors with no tied entries; otherwise
            sends copy as usual, and ``status()`` says why. No snapshot is kept
            (``retain_snapshot`` is False): late joiners get the next version. Nothing
            may change the model's tensors while ``send()`` runs; if a worker may still
            be reading when it returns (a timeout, a stopped worker), or a transport
            still queues a chunk of it, the model moves to another buffer first, so
            that worker reads one whole version. ``send_async()`` copies, as without it.
        lend_tensors: write each version straight into the tensors of the workers on
            this host that lend them (a ``WeightReceiver``'s default: pipes,
            ``ipc://``, Ray actors), on by default (``False``: stream every version);
            versions of under 4 MiB of large tensors stream all the same. Each worker
            is asked to take its lock and written once it says go (one copy per
            worker, from the model's own tensors); those that
            do not say go within half a second (or ``timeout``) are streamed to. When
            every worker the sender expects (``num_workers``) took the version that way
            the snapshot is not written: a worker that joins after it gets the next
            version (one expected and absent at the send joins to the snapshot). One
            hub, whole copies only: not with ``delta``, ``wire_dtype``, slices,
            ``share_params`` or a sharded learner.
        wire_dtype: floating tensors of another dtype travel as this one (``torch.
            bfloat16``, ``torch.float16``, ``torch.float32`` or a float8), cast chunk by
            chunk as they are written (nothing model-sized), and each worker casts them
            back to its tensor's own dtype. Integer and bool tensors travel as they are.
            ``chunk_bytes`` must then be a multiple of 16. With it, ``share_params``
            copies (the wire bytes are not the tensors').
        delta: send each worker only the blocks of the stream (1 MiB, or ``chunk_bytes``
            if smaller) that changed since the version it holds, as a digest of each
            block says: over a transport that fans out (PUB/SUB) one delta against the
            oldest version the targeted workers hold, else one per worker. A worker
            that cannot apply it (it missed a version the delta is not against, it
            restarted, its model is torn, or it joined late) gets the whole version
            from the snapshot, never a wrong one. Each version is then copied whole
            before its first chunk goes (to digest it); it needs ``retain_snapshot``
            and no ``share_params``, and assumes workers do not change the weights they
            were sent. With ``wire_dtype``, the wire bytes are digested.
        part: a sharded learner's rank (a scheme makes it for a model of DTensors): each
            version streams this rank's part only, its local boxes of the global tensors.
            Every rank sends each version (``send()`` is a collective call), with the
            same ``epoch``. With ``delta`` each rank digests its own part (one that did
            not change sends one empty chunk); with ``wire_dtype`` each casts its own;
            workers see rank 0's ``metadata``.
        ranks: every rank's endpoint, rank 0's first, which this sender's Welcome names:
            a worker opens a session with each, and gathers a version's parts. A worker
            that declares slices (a tensor-parallel worker: ``WeightReceiver(slices=)``)
            is sent, by each rank, only the bytes of its part inside them, addressed.
    """

    def __init__(
        self,
        hub: HubTransport | Sequence[HubTransport],
        *,
        model_id: str = "policy",
        model: Any = None,
        strategy: Strategy = "tensordict",
        num_workers: int | None = None,
        timeout: float = 10.0,
        retain_snapshot: bool = True,
        heartbeat: float = 1.0,
        repair_after: float = 1.0,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        mode: str = "",
        epoch: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksums: bool = False,
        share_params: bool = False,
        wire_dtype: torch.dtype | None = None,
        delta: bool = False,
        part: LocalPart | None = None,
        ranks: Sequence[str] = (),
        lend_tensors: bool | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds; got {timeout}")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}; "
                f"got {chunk_bytes}"
            )
        if wire_dtype is not None and chunk_bytes % 16:
            raise ValueError(
                f"with wire_dtype, chunk_bytes must be a multiple of 16; got {chunk_bytes}"
            )
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0; got {num_workers}")
        if part is not None and share_params:
            raise ValueError(
                "share_params=True cannot serve a sharded learner's part: its boxes of "
                "local shards are not the module's tensors laid out whole in one block"
            )
        if delta and (share_params or not retain_snapshot):
            raise ValueError(
                "delta=True needs retain_snapshot=True and no share_params: a worker "
                "that cannot apply a delta is sent the whole version from the snapshot"
            )
        if part is not None and ranks and len(ranks) != part.parts:
            raise ValueError(
                f"part {part.part} of {part.parts} needs {part.parts} ranks' endpoints; "
                f"got {len(ranks)}"
            )
        hubs = [hub] if isinstance(hub, HubTransport) else list(hub)
        if not hubs:
            raise ValueError("a sender needs at least one hub transport")
        self.model_id = model_id
        self.model = model
        self.strategy = strategy
        self.timeout = float(timeout)
        self.share_params = share_params
        #: Write each version straight into the tensors of workers that lend them (on
        #: this host), one copy each, instead of streaming it (see _write_lent).
        self.lend_tensors = lend_tensors is not False and not share_params and part is None
        #: The memory each worker lent, as the tensors of the layout it was mapped for.
        self._lent_targets: dict[PeerId, LentTarget] = {}
        #: Workers that did not say go in time, and the version they missed: not asked
        #: again until they acked it or a later one (see _not_passed_over).
        self._missed_go: dict[PeerId, int] = {}
        #: How versions of the current layout are written into them.
        self._lent_plan: tuple[WeightsSchema, LentPlan | None] | None = None
        self.retain_snapshot = retain_snapshot and not share_params
        self.heartbeat = heartbeat
        self.repair_after = repair_after
        self.mode = mode or "+".join(h.name for h in hubs)
        epoch = epoch if epoch is not None else new_epoch()
        self.fleet = Fleet(
            model_id,
            epoch,
            mode=self.mode,
            strategy=strategy,
            transports=[h.name for h in hubs],
            announced=[h.announce() if isinstance(h, Announces) else {} for h in hubs],
            num_workers=num_workers,
            heartbeat=heartbeat,
            repair_after=repair_after,
            ranks=ranks,
            part=None if part is None or part.parts < 2 else part.part,
        )
        self.chunk_bytes = int(chunk_bytes)
        self.checksums = checksums
        self.wire_dtype = wire_dtype
        self.delta = delta
        #: Called (on a pump's thread) when a worker needs the latest version and none
        #: is kept: True if it is on its way all the same (the worker is told so, and
        #: waits for it), False if the worker waits for the next send. A relay that keeps
        #: no snapshot sets it, to fetch the version from its upstream again.
        self.on_unserved: Callable[[], bool] | None = None
        self._stats = SendStats()
        clock = StallClock()  # one for every hub: a stopped peer is known to all
        self._runners = [
            HubRunner(_Pumps(self), h, i, stats=self._stats, clock=clock, name=model_id)
            for i, h in enumerate(hubs)
        ]
        #: A sharded learner's rank: (this rank, how many), for status().
        self._rank = None if part is None else (part.part, part.parts)
        self._versions = VersionStore(
            self._runners,
            Stamp(model_id, epoch, checksums),
            strategy=strategy,
            chunk_bytes=self.chunk_bytes,
            stats=self._stats,
            retain_snapshot=self.retain_snapshot,
            share_params=share_params,
            wire_dtype=wire_dtype,
            pack_threshold=pack_threshold,
            part=part,
            delta=delta,
        )
        self._metadata: Metadata | None = None  # the latest version's
        #: Whether versions go as parts (boxes travel only in parts of two or more).
        self._sharded = part is not None and part.parts > 1
        #: Workers that hold slices (tensor-parallel), and each version cut for them.
        self._sliced = SlicedWorkers(self.chunk_bytes, self._versions.whole)
        #: ``_cond`` guards the fleet, the pending send and the forwarded version.
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._pending: Pending | None = None
        #: A relay's version in progress (see begin_forward), and its send.
        self._forwarding: Forwarding | None = None
        self._async_pending = False
        self._closed = False
        self._pump_error: BaseException | None = None
        self._started = time.monotonic()
        self._last_expiry = self._started
        self._last_error_log = float("-inf")
        for h in hubs:
            if isinstance(h, ZeroCopy):
                h.zero_copy_from(MIN_CHUNK_BYTES)  # chunks go from the sender's own memory
        for runner in self._runners:
            # One hub: the sending thread reads the acks (see _await_acks).
            runner.start(wake_for_acks=len(self._runners) > 1)
        if model is not None:
            self.publish()

    # --- public API ------------------------------------------------------------------

    @property
    def num_workers(self) -> int | None:
        """Workers ``0..num_workers-1`` that a send targets by default (None: every
        live worker)."""
        return self.fleet.num_workers

    @num_workers.setter
    def num_workers(self, value: int | None) -> None:
        with self._cond:
            self.fleet.num_workers = value

    @property
    def version(self) -> int:
        """The latest version sent (0 before the first send)."""
        return self.fleet.version

    @property
    def epoch(self) -> int:
        """This sender's life, which every chunk carries (a relay's: its upstream's)."""
        return self._versions.stamp.epoch

    @property
    def published_changed(self) -> bool:
        """Whether version 0, published without a copy (``retain_snapshot=False``), was
        found changed in place as a worker was served: it can no longer be sent."""
        snapshot = self._versions.snapshot
        return self.version == 0 and snapshot is not None and snapshot.changed

    @property
    def endpoint(self) -> str:
        """The address workers (and ``zmqsync status``) connect to (the first hub's)."""
        return self._runners[0].hub.endpoint

    @property
    def transport(self) -> HubTransport:
        """The first hub transport."""
        return self._runners[0].hub

    @property
    def transports(self) -> list[HubTransport]:
        """Every hub this sender serves through (a mixed fleet has several)."""
        return [r.hub for r in self._runners]

    def send(
        self, weights: Any = None, worker_ids: WorkerIds = None, *, metadata: Metadata | None = None
    ) -> None:
        """Send weights and return once every targeted worker has applied them.

        ``weights``: ``None`` (extract from the model), an ``nn.Module``, a ``TensorDict``
        or a ``dict`` of tensors. ``worker_ids``: ``None`` (all), an ``int`` or a list.
        ``metadata``: a small JSON-able dict tagging the version (e.g. the optimizer
        step); workers see it as ``receiver.metadata``, late joiners too.

        Raises :class:`SyncTimeout` (a ``TimeoutError``) naming the workers that did not
        ack within ``timeout``, or :class:`WeightsRejected` if some refused the version.
        The sender stays usable after either, and no transport holds ``weights``' memory
        once it returned or raised.
        """
        with self._send_lock:
            if self._async_pending:
                raise RuntimeError("a send_async() is still pending: call wait_async() first")
            # One hub: keep it from the first frame to the last ack (one thread handoff).
            with (
                self._runners[0].holding() if len(self._runners) == 1 else contextlib.nullcontext()
            ):
                pending = self._start(weights, worker_ids, metadata=metadata)
                self._finish(pending)

    def send_async(
        self, weights: Any = None, worker_ids: WorkerIds = None, *, metadata: Metadata | None = None
    ) -> None:
        """Start a send and return once the weights are copied; :meth:`wait_async`
        completes it. The weights may change as soon as this returns.

        Raises ``RuntimeError`` if a previous send_async is pending.
        """
        with self._send_lock:
            if self._async_pending:
                raise RuntimeError(
                    "a send_async() is still pending: call wait_async() before the next send"
                )
            # It returns before the stream ends and the weights may change then: a
            # whole copy, even without a snapshot.
            pending = self._start(weights, worker_ids, whole=True, metadata=metadata)
            pending.copy.write_through(pending.copy.count - 1)
            self._async_pending = True

    def wait_async(self) -> None:
        """Wait for the pending :meth:`send_async` to be acked (same errors as send).

        Raises ``RuntimeError`` if no send_async is pending.
        """
        with self._send_lock:
            if not self._async_pending or self._pending is None:
                raise RuntimeError("no send_async() is pending: nothing to wait for")
            pending = self._pending
            self._async_pending = False
        self._finish(pending)

    def update_weights(self, weights: Any) -> None:
        """Send weights to ALL workers (legacy name of ``send(weights)``)."""
        self.send(weights)

    def publish(self, weights: Any = None) -> None:
        """Make ``weights`` (``None``: the model's) what a worker gets when it connects
        before the first send, as version 0: ``connect()`` is a rendez-vous for the
        learner's weights. Waits for nobody. A sender built with a model publishes it
        at once; call this again (before the first send) to publish newer weights to
        workers that have not connected yet.

        With ``retain_snapshot`` (the default) the weights are copied now, and may
        change as soon as this returns. Without it nothing model-sized is made: each
        chunk's checksum is taken now (one read of the weights), and the chunks are
        read from the weights again when a worker is served, as a send reads them, and
        checked. Version 0 is the weights as of this call either way: if they change in
        place before the first send (a checkpoint loaded after ``init_on_sender``),
        call this again; otherwise they can no longer be sent as version 0, and a
        worker that connects then waits for the first send's version (never one whole
        version mixed with another, nor its own initial weights).
        """
        with self._send_lock:
            self._check_open()
            if self.fleet.version > 0:
                raise RuntimeError("publish() is for the weights before the first send()")
            versions = self._versions
            if self.retain_snapshot:
                copy = versions.copy_of(weights, 0, model=self.model)
                if self.delta:
                    versions.record(copy)
                copy.write_through(copy.count - 1)  # the weights may change once this returns
            else:
                copy = versions.rendezvous(weights, self.model)
            versions.serve(copy)  # kept until the first send
            with self._cond:
                self.fleet.published = True

    def free_worker_id(self) -> int:
        """The lowest worker id that no session holds and no hub reserves (a pipe's or
        an actor's index): what a worker that asks for an id gets."""
        reserved = {r.index: reserved_workers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.free_worker_id(reserved)

    # --- the send path ---------------------------------------------------------------

    def _start(
        self,
        weights: Any,
        worker_ids: WorkerIds,
        *,
        whole: bool = False,
        metadata: Metadata | None = None,
    ) -> Pending:
        self._check_open()
        if metadata is not None:
            encode_metadata(metadata)  # refused before any work: not a dict, too large
        with self._cond:
            self.fleet.targets(worker_ids, time.monotonic())  # bad ids raise before any work
            version = self.fleet.version + 1
        # Without a snapshot, a synchronous send streams through the ring: it reads the
        # caller's tensors until it returns, and nothing model-sized is made.
        versions = self._versions
        # Sliced workers are sent cuts of the version's whole bytes.
        whole = whole or self.retain_snapshot or len(self._sliced) > 0
        copy = versions.copy_of(weights, version, model=self.model, whole=whole)
        copy.metadata = metadata
        self._metadata = metadata
        if self.delta:
            versions.record(copy)
        with self._cond:
            send, peers = self.fleet.begin_send(worker_ids, time.monotonic(), self.timeout)
            pending = self._pending = Pending(send, copy)
            holdings = self.fleet.holdings(send.targets) if self.delta else {}
            everyone = self._peers_of(self.fleet.workers) if len(self._sliced) else {}
            targeted = self._peers_of(send.targets) if everyone else {}
            routes: dict[PeerId, tuple[int, ...]] = {}
            for relay, behind in send.routes.items():
                s = self.fleet.workers.get(relay)
                if s is not None and s.origin.peer is not None:
                    routes[s.origin.peer] = behind
        written = self._write_lent(copy, send, peers, worker_ids) if self._lends(copy) else set()
        if written:
            pending.lent = written
            with self._cond:
                everyone = everyone or self._peers_of(self.fleet.workers)
        deltas: dict[int, tuple[int, int]] = {}  # base -> (workers, bytes each)
        for runner in self._runners:
            if self.delta:
                transfers = versions.delta_transfers(
                    copy,
                    holdings.get(runner.index, []),
                    worker_ids is None,
                    fans_out=runner.hub.fans_out,
                    lending=runner.lending(),
                )
            elif worker_ids is None:
                transfers = [Transfer(copy, None)]
            elif peers.get(runner.index):
                transfers = [Transfer(copy, list(peers[runner.index]))]
            else:
                transfers = []
            if routes:
                transfers = self._routed(transfers, routes)
            if written:  # those the version was written into are streamed nothing
                transfers = _without(transfers, everyone.get(runner.index, []), written)
            if everyone.get(runner.index) and len(self._sliced):
                transfers = self._unsliced(transfers, runner.index, everyone[runner.index])
            for transfer in transfers:
                runner.begin(transfer)
                if transfer.spans is not None:
                    n, _ = deltas.get(transfer.base, (0, 0))
                    deltas[transfer.base] = (n + transfer.workers, transfer.nbytes)
        if targeted:
            self._send_cuts(copy, targeted)
        self._stats.version_sent(
            version, copy.nbytes, len(send.targets), deltas if self.delta else None
        )
        return pending

    def _finish(self, pending: Pending) -> None:
        send = pending.send
        self._await_acks(send)
        # Whoever the transfers reached, the version is whole in the sender's memory
        # before send() returns (the caller may change its weights then); a ring copy
        # stops reading them, and its streams still under way stop.
        copy = pending.copy
        if (
            pending.lent
            and not copy.written
            and self._nobody_streams(copy)
            and self._everyone_holds(send)
        ):
            # Every worker took it into its lent tensors, no stream read it and every
            # worker the sender expects holds it: it is never written here, and serves
            # nobody (a worker that leaves and joins again gets the next one). The hub
            # keeps no memory written for the versions before, which nobody reads.
            copy.forgo()
            self._versions.serve(None)
            hub = self._runners[0].hub
            if copy.lent_by_hub and isinstance(hub, Lends):
                hub.unwritten(copy.data)
        else:
            copy.write_through(copy.count - 1)
        if copy.data is None or copy.live:
            copy.end()
            for runner in self._runners:
                runner.drop_unreadable()
        if copy.live:
            if self._versions.shares_own_memory:
                # Sent from the sender's own memory (the hub lends none): a transport
                # that still queues a chunk of it (a stopped worker's) holds it.
                reading = not _let_go(copy)
            else:
                with self._cond:
                    reading = self.fleet.may_still_read(copy.version, copy.reached)
            if reading and self.model is not None:
                # The caller may change its tensors once this returns: they move to
                # another block, and whoever reads this one reads one whole version.
                self._versions.share(self.model)
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
            self._stats.add("timeouts")
            with self._cond:
                transports = {w: self.fleet.transport_of(w) for w in missing}
                waiting = self.fleet.waiting_for(missing, send.version)
            ranks = sorted({r for parts in waiting.values() for r in parts})
            raise SyncTimeout(
                self._timeout_message(send, missing) + self._ranks_message(waiting),
                missing_workers=missing,
                version=send.version,
                transports=transports,
                missing_ranks=ranks,
            )
        if rejected:
            details = "; ".join(f"worker {w}: {r}" for w, r in sorted(rejected.items()))
            raise WeightsRejected(
                f"version {send.version} was rejected by {len(rejected)} worker(s): {details}",
                rejections=rejected,
                version=send.version,
            )
        self._stats.synced(time.monotonic() - send.started)

    # --- lent tensors: one copy per worker, straight into its model -----------------

    def _lends(self, copy: Copy) -> bool:
        """Whether this version may be written into workers' lent tensors: one hub, a
        whole copy of the model's own bytes (no delta, cast, slices or parts)."""
        if not (
            self.lend_tensors
            and copy.nbytes >= LENT_MIN_BYTES
            and len(self._runners) == 1
            and not self.delta
            and not len(self._sliced)
            and copy.data is not None
            and not copy.live
            and copy.tensors is not None
        ):
            return False
        plan = self._plan_for(copy.layout.schema)
        return plan is not None and plan.large_bytes >= LENT_MIN_BYTES

    def _plan_for(self, schema: WeightsSchema) -> LentPlan | None:
        """How a version of ``schema`` is written into lent memory (made once per
        schema); None if it cannot be (a tensor cast on the wire, or in a buffer of its
        own)."""
        kept = self._lent_plan
        if kept is None or kept[0] is not schema:
            try:
                plan: LentPlan | None = LentPlan(schema)
            except ValueError:
                plan = None
            kept = self._lent_plan = (schema, plan)
        return kept[1]

    def _write_lent(
        self,
        copy: Copy,
        send: Send,
        peers: Mapping[int, Sequence[PeerId]],
        worker_ids: WorkerIds,
    ) -> set[PeerId]:
        """Ask every targeted worker that lent its tensors for this layout to hold its
        lock, and write the version into those that say go, as they do, for at most
        :data:`LENT_GO_WAIT` seconds; the others are told nothing was written (they get
        the stream). Returns the workers written."""
        runner = self._runners[0]
        hub = runner.hub
        if not isinstance(hub, Lends):
            return set()
        layout = copy.layout.layout
        asked = hub.lent_peers(layout)
        if worker_ids is not None:
            targeted = set(peers.get(runner.index, ()))
            asked = [p for p in asked if p in targeted]
        asked = self._not_passed_over(asked)
        if not asked:
            return set()
        epoch, version = self._versions.stamp.epoch, copy.version
        meta = b"" if copy.metadata is None else encode_metadata(copy.metadata)
        tensors = copy.tensors
        assert tensors is not None
        plan = self._plan_for(copy.layout.schema)
        assert plan is not None  # _lends() said so
        for peer in asked:
            hub.ask_lent(peer, version, epoch, layout)
        # The small tensors are gathered while the workers take their locks: the copy
        # overlaps the asks' round trip instead of following it.
        gathered = plan.gather(tensors)
        waiting, written = set(asked), set[PeerId]()
        # Workers that said go are written together once every asked one did, or once
        # the first has waited as long as writing it alone would take (a later go
        # would wait that long anyway, behind its copy).
        ready: dict[PeerId, LentTarget] = {}
        still_writing = StillWriting(hub, ready, version, epoch, layout)
        ready_since = 0.0
        batch_wait = plan.total / LENT_WRITE_BYTES_PER_SECOND
        deadline = min(send.deadline, time.monotonic() + LENT_GO_WAIT)
        while waiting:
            now = time.monotonic()
            if ready and now >= ready_since + batch_wait:
                self._write_ready(ready, gathered, version, epoch, meta, written, still_writing)
            still_writing()  # to those waiting for the others' go
            remaining = deadline - now
            if remaining <= 0:
                break
            wait = min(remaining, ready_since + batch_wait - now) if ready else remaining
            with runner.holding():
                incoming = runner.hub.recv_frames(max(0.0, min(wait, pump.PUMP_TICK)))
                while incoming is not None:
                    self._handle(incoming, runner)
                    incoming = runner.hub.recv_frames(0)
            for peer, v, e, ok in hub.take_gos():
                if peer not in waiting or (v, e) != (version, epoch):
                    if ok:  # a go for an ask given up on: it holds its lock, release it
                        hub.written(peer, v, e, False, b"")
                    continue
                waiting.discard(peer)
                target = self._lent_target(peer, plan) if ok else None
                if target is None:
                    if ok:  # the memory it lends cannot be mapped (any more)
                        hub.written(peer, version, epoch, False, b"", unusable=True)
                    continue
                if not ready:
                    ready_since = time.monotonic()
                ready[peer] = target
        if ready:  # they hold their locks: written even past the deadline
            self._write_ready(ready, gathered, version, epoch, meta, written, still_writing)
        for peer in waiting:
            hub.written(peer, version, epoch, False, b"")  # it gets the stream instead
            self._missed_go[peer] = version
            self._stats.add("lent_go_missed")
        return written

    def _write_ready(
        self,
        ready: dict[PeerId, LentTarget],
        gathered: Gathered,
        version: int,
        epoch: int,
        meta: bytes,
        written: set[PeerId],
        still_writing: Callable[[], object],
    ) -> None:
        """Write the version into the workers in ``ready`` (all at once), tell each it
        is in, and move them to ``written``."""
        LentTarget.write_all(list(ready.values()), gathered, still_writing)
        hub = self._runners[0].hub
        assert isinstance(hub, Lends)
        for peer in ready:
            hub.written(peer, version, epoch, True, meta)
        written.update(ready)
        ready.clear()

    def _not_passed_over(self, lenders: list[PeerId]) -> list[PeerId]:
        """``lenders`` but those that missed their go for a version they have not acked
        since (stopped, or stuck in a forward pass): they get the stream without being
        asked, so a stopped worker holds the stream to the others back in one send, not
        in every send. One that acked that version or a later one is asked again."""
        missed = self._missed_go
        if not missed:
            return lenders
        lending = set(lenders)
        with self._cond:
            held = {
                s.origin.peer: s.version
                for s in self.fleet.workers.values()
                if s.origin.peer in missed
            }
        # Only peers still lending are kept: the table is as bounded as the hub's.
        self._missed_go = missed = {
            p: v for p, v in missed.items() if p in lending and held.get(p, -1) < v
        }
        return [p for p in lenders if p not in missed]

    def _lent_target(self, peer: PeerId, plan: LentPlan) -> LentTarget | None:
        """The memory ``peer`` lent, as ``plan`` writes it (kept per peer while the plan
        stays); None if the hub could not map it."""
        hub = self._runners[0].hub
        # The hub's mapping of what the worker lends now: a worker that took its
        # tensors back and lent anew has new memory, never the memory it had.
        memory = hub.lent_memory(peer, plan.total) if isinstance(hub, Lends) else None
        if memory is None:
            self._lent_targets.pop(peer, None)
            return None
        kept = self._lent_targets.get(peer)
        if kept is not None and kept.plan is plan and kept.memory is memory:
            return kept
        target = LentTarget(memory, plan)
        if len(self._lent_targets) >= MAX_LENT_TARGETS:
            self._lent_targets.pop(next(iter(self._lent_targets)))
        self._lent_targets[peer] = target
        return target

    def _everyone_holds(self, send: Send) -> bool:
        """Whether every worker the sender expects (``0..num_workers-1``; with None,
        whoever is connected) holds ``send``'s version: none of them is missing, none
        is absent. A worker expected and absent joins later to the snapshot."""
        with self._cond:
            if send.missing:
                return False
            expected = self.fleet.num_workers
            if expected is None:
                return True
            workers = self.fleet.workers
            return all(
                (s := workers.get(w)) is not None and s.left is None and s.version == send.version
                for w in range(expected)
            )

    def _nobody_streams(self, copy: Copy) -> bool:
        """Whether no transfer or repair streams ``copy`` (holding every hub)."""
        with contextlib.ExitStack() as held:
            for runner in self._runners:
                held.enter_context(runner.holding())
            return not copy.reached and not any(r.streams(copy) for r in self._runners)

    def _peers_of(self, workers: Iterable[int]) -> dict[int, list[PeerId]]:
        """Per hub, the peers of ``workers`` that have one (holding the condition)."""
        out: dict[int, list[PeerId]] = {}
        for w in workers:
            s = self.fleet.workers.get(w)
            if s is not None and s.origin.peer is not None and s.left is None:
                out.setdefault(s.origin.hub, []).append(s.origin.peer)
        return out

    def _routed(
        self, transfers: list[Transfer], routes: dict[PeerId, tuple[int, ...]]
    ) -> list[Transfer]:
        """``transfers`` with each relay a version is routed through on a transfer of its
        own, whose first chunk names the workers behind it that the version is for."""
        out = []
        for t in transfers:
            routed = [p for p in t.to or [] if p in routes]
            rest = [p for p in t.to or [] if p not in routes]
            if not routed:
                out.append(t)
                continue
            if rest:
                out.append(Transfer(t.copy, rest, t.spans, t.base, len(rest) if t.spans else 0))
            for p in routed:
                each = 1 if t.spans is not None else 0
                out.append(Transfer(t.copy, [p], t.spans, t.base, each, targets=routes[p]))
        return out

    def _unsliced(
        self, transfers: list[Transfer], hub: int, everyone: list[PeerId]
    ) -> list[Transfer]:
        """``transfers`` to hub ``hub`` with its sliced workers taken out: a fan-out is
        then addressed to the others (``everyone`` but them)."""
        sliced = self._sliced.sliced(hub, everyone)
        return _without(transfers, everyone, set(sliced)) if sliced else transfers

    def _send_cuts(self, copy: Copy, targeted: dict[int, list[PeerId]]) -> None:
        """Send each targeted sliced worker its cut of ``copy``, addressed. Cut holding
        every hub, once each began the version's stream: no pump reads an older copy
        meanwhile (whose memory ``copy`` may have taken over, and is now written)."""
        with contextlib.ExitStack() as held:
            for runner in self._runners:
                held.enter_context(runner.holding())
            for runner in self._runners:
                for peer in self._sliced.sliced(runner.index, targeted.get(runner.index, [])):
                    cut = self._sliced.cut_for(runner.index, peer, copy)
                    if cut is not None:
                        runner.begin(Transfer(cut, [peer]))

    # --- waiting for acks ------------------------------------------------------------

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
                    wait = pump.WINDOW_WAIT if streaming else pump.PUMP_TICK
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

    @staticmethod
    def _ranks_message(waiting: dict[int, tuple[int, ...]]) -> str:
        """For a sharded learner's rank: the ranks whose parts the workers still wait
        for (a rank that died, stopped or is late), and who waits for each."""
        if not waiting:
            return ""
        by_rank: dict[int, list[int]] = {}
        for w, parts in sorted(waiting.items()):
            for r in parts:
                by_rank.setdefault(r, []).append(w)
        said = "; ".join(
            f"rank {r} (worker(s) {', '.join(map(str, ws))})" for r, ws in sorted(by_rank.items())
        )
        ranks = ", ".join(map(str, sorted(by_rank)))
        return (
            f". The workers lack the part(s) of missing rank(s) {ranks}: "
            f"{said}; no worker applies the version without them. Check that every rank is "
            "alive and called send() for this version"
        )

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

    # --- for a relay: versions it forwards rather than copies ------------------------

    def begin_forward(
        self, chunk: Chunk, targets: Iterable[int] | None = None
    ) -> tuple[Forwarded, bool]:
        """Start sending on a version this sender did not copy (a relay's, from its
        upstream), from its first ``chunk``: to every worker as its chunks come, or to
        ``chunk.targets``, or (``targets``) to those that lack the version held, fetched
        again. Returns the forwarded version, to give :meth:`forward_chunk` each chunk,
        and whether it restarts the forward of that version (streamed again upstream).

        A chunk of another epoch makes it this sender's: its workers follow the
        upstream's life, and the snapshot of the life before is served to nobody."""
        again = targets is not None
        wanted = chunk.targets if targets is None else tuple(targets)
        copy = Forwarded(chunk)
        with self._cond:
            if chunk.epoch != self.epoch:
                self._versions.new_life(chunk.epoch)
            now, old = time.monotonic(), self._forwarding
            send = None if again else self.fleet.restart_forward(chunk.version, chunk.epoch, now)
            restart = send is not None and old is not None
            if send is None or old is None:
                send = self.fleet.begin_forward(
                    chunk.version, chunk.epoch, now, self.timeout, wanted, again=again
                )
                to = None if wanted is None else send.targets
            else:
                # Anew from its first chunk, never spliced onto the stream it replaces
                # (ended): the way that one went, fanned out (on the same path, after
                # its chunks), or to those its send still waits for.
                to = None if old.copy.reached is None else frozenset(send.missing)
            peers = {} if to is None else self._peers_of(to)
            # Until each hub's runner has begun it, a worker asking for the version the
            # fleet now counts is told it is on its way (not repaired, nor fetched again
            # upstream by a relay without a snapshot).
            starting: dict[int, frozenset[PeerId] | None] = {
                r.index: None if to is None else frozenset(peers[r.index])
                for r in self._runners
                if to is None or peers.get(r.index)
            }
            forwarding = self._forwarding = Forwarding(send, copy, starting)
            self._metadata = chunk.metadata
        try:
            for runner in self._runners:
                if to is None:
                    runner.begin(Transfer(copy, None))
                elif peers.get(runner.index):
                    # Only to the workers (and relays) it is for: they filter it further.
                    runner.begin(Transfer(copy, peers[runner.index]))
        finally:
            # Also when a runner's begin raised: its peers' asks are then answered as
            # usual, not counted as on their way until the next version.
            forwarding.starting = {}
        if restart:
            self._stats.add("bytes_sent", copy.nbytes * max(1, len(send.targets)))
        else:
            self._stats.version_sent(copy.version, copy.nbytes, len(send.targets), None)
        return copy, restart

    def forward_chunk(self, copy: Forwarded, index: int, frames: list[Any]) -> None:
        """Chunk ``index`` of a forwarded version came, as ``frames``: send it on now
        (cut-through)."""
        copy.add(index, frames)
        for runner in self._runners:
            runner.send_more()

    def abort_forward(self, copy: Forwarded) -> None:
        """The forwarded version's stream broke (or the relay closes): nothing more of it
        will come, and what is left of it is sent to nobody."""
        copy.end()

    def forward_settled(self, version: int, epoch: int) -> bool:
        """Whether every worker an ack upstream of ``version`` (of the upstream's
        ``epoch``) waits for holds it: those it was forwarded to (its targets, when it
        came with some), else every live one."""
        with self._cond:
            forwarding = self._forwarding
            forward = None if forwarding is None else forwarding.send
            return self.fleet.settled(version, epoch, forward, time.monotonic())

    def forward_refusals(self, version: int, relay: int | None) -> str:
        """Why workers refused ``version`` (the version forwarded), in one line, each
        named, for relay ``relay``'s ack upstream; empty when none did."""
        with self._cond:
            forwarding = self._forwarding
            forward = None if forwarding is None else forwarding.send
            return self.fleet.refusals(version, forward, relay)

    def lacking(self, version: int) -> tuple[int, ...]:
        """Workers not gone that do not hold ``version`` of this epoch whole."""
        with self._cond:
            return self.fleet.lacking(version)

    def below(self, limit: int) -> dict[str, int]:
        """Its workers not gone and the version each holds, with those behind its own
        relays, at most ``limit`` (what a relay's heartbeats say upstream)."""
        with self._cond:
            return self.fleet.below(limit)

    @property
    def snapshot(self) -> Copy | None:
        """The copy late joiners and repairs are served from now (None: none is kept)."""
        return self._versions.snapshot

    def serve_whole(
        self, version: int, layout: StreamLayout, data: np.ndarray, metadata: Metadata | None
    ) -> Copy | None:
        """Serve ``version``, whole in ``data`` (laid out as ``layout``, held by the
        caller, and not to be changed while it is served), to late joiners and repairs
        from now on, even while a newer version is forwarded; returns the copy served
        until now (see :meth:`still_read`)."""
        return self._versions.serve(self._versions.whole(version, layout, data, metadata))

    def still_read(self, copy: Copy) -> bool:
        """Whether a transfer still streams ``copy`` or a transport holds its memory: its
        buffer may be written again only once neither does."""
        return self._versions.still_read(copy)

    # --- what the pumps do with workers' messages ------------------------------------

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
            self._stats.add("message_errors")
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
        if (
            isinstance(message, Hello)
            and peer is not None
            and not self._declared(message, runner, peer)
        ):
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

    def _declared(self, hello: Hello, runner: HubRunner, peer: PeerId) -> bool:
        """Take the slices a worker's Hello declares (none: it gets whole tensors); False
        if they are refused (counted, and the worker told why): they do not fit this
        rank's tensors, this learner is not sharded, or it serves too many such workers."""
        if hello.slices and not self._sharded:
            self._sliced.refused += 1
            reason: str | None = (
                "this sender is no rank of a sharded learner (a learner of one process, or "
                "a relay): a worker that holds slices connects to a sharded learner's "
                "ranks, which each cut their part for it"
            )
        else:
            layout = self._versions.layout
            schema = None if layout is None else layout.schema
            reason = self._sliced.declare(runner.index, peer, hello.slices, schema)
        if reason is None:
            return True
        self._refuse(runner, peer, "malformed", f"Hello.slices refused: {reason}")
        return False

    def _status_asked(self, runner: HubRunner, peer: PeerId) -> None:
        """Answer a status request now, or, while a send waits for acks, with the next
        report (see STATUS_INTERVAL)."""
        waiting = runner.status_askers
        if peer not in waiting:
            if len(waiting) >= STATUS_WAITING:
                self._stats.add("status_dropped")
                return
            waiting.append(peer)
        if not self._answer_askers(runner):
            self._stats.add("status_deferred")

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
        reply = encode(StatusReply(self.model_id, self.version, self.epoch, self.status()))
        for peer in askers:
            runner.hub.send_frames(reply, to=[peer])
        return True

    def _send_waiting(self) -> bool:
        """Whether a send waits for acks now (until they came, or its deadline)."""
        pending = self._pending
        if pending is None:
            return False
        send = pending.send
        return not send.done and time.monotonic() < send.deadline

    def _latest(self) -> Copy | None:
        """The latest version's stream, or None if the sender keeps none (a relay
        serves the latest it holds whole)."""
        version = self.fleet.version
        pending = self._pending
        return self._versions.latest(
            version,
            None if pending is None else pending.copy,
            held=self._forwarding is not None,
        )

    def _carry_out(self, effects: Iterable[Any], runner: HubRunner) -> None:
        """Do what the fleet core decided, on this runner's hub (which this thread
        holds); effects for other hubs wait for their own pump."""
        for effect in effects:
            hub_index = effect.hub if isinstance(effect, FanOut) else effect.origin.hub
            if hub_index != runner.index:
                self._runners[hub_index].later.append(effect)
                continue
            hub = runner.hub
            if isinstance(effect, Forget) and effect.origin.peer is not None:
                self._sliced.forget(runner.index, effect.origin.peer)
            if isinstance(effect, Reply):
                if effect.origin.peer is not None:
                    hub.send_frames(encode(effect.message), to=[effect.origin.peer])
            elif isinstance(effect, SendLatest):
                if effect.origin.peer is None:
                    continue
                if runner.forwarding_to(effect.origin.peer):
                    # A relay's next version is still streaming to it: what it lacks is
                    # on its way (what it asks for once it is all sent, it lost).
                    self._stats.add("repairs_skipped")
                    continue
                latest = self._latest()
                if latest is not None and self._sliced.sliced(runner.index, [effect.origin.peer]):
                    latest = self._sliced.cut_for(runner.index, effect.origin.peer, latest)
                if latest is None:
                    self._unserved(effect, hub)
                elif runner.repair(latest, effect.origin.peer):
                    self._stats.add("repairs_sent")
                    self._stats.add("repair_bytes", latest.nbytes)
                else:
                    self._stats.add("repairs_skipped")
                    with self._cond:  # on its way after all: its next ask may be served
                        self.fleet.repair_turned_down(effect.origin, time.monotonic())
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
        and gets the next version. Told it is on its way instead (so that its
        connect() waits for it) when ``on_unserved`` says it is, or when version 0
        changed in place since it was published (it waits for the first send)."""
        assert effect.origin.peer is not None
        message = effect.otherwise
        on_unserved = self.on_unserved
        if isinstance(message, UpToDate) and (
            (on_unserved is not None and on_unserved()) or self.version == 0
        ):
            message = dataclasses.replace(message, in_flight=True)
        hub.send_frames(encode(message), to=[effect.origin.peer])

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

    # --- status ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The sync state as a JSON-ready dict (what ``zmqsync status`` shows): the
        fields of :meth:`report`, as ``report().as_dict()``."""
        return self.report().as_dict()

    def report(self) -> SenderStatus:
        """The sync state as a :class:`~zmqsync.SenderStatus`: version, uptime,
        per-worker state, totals.

        At most :data:`~zmqsync.fleet.STATUS_ROWS` worker rows (the furthest behind
        first); ``workers_total`` counts them all.
        """
        now = time.monotonic()
        copying = self._copying()
        with self._cond:
            workers, counts = self.fleet.status_rows(now, copying)
            fleet_counters = dict(self.fleet.counters)
            reasons = list(self.fleet.reasons)
            waiting = self._waiting_ranks()
        totals = self._stats.report(
            fleet_counters, reasons, sum_counters(counters(r.hub) for r in self._runners)
        )
        share_problem = self._versions.share_problem
        return SenderStatus(
            model_id=self.model_id,
            version=self.version,
            epoch=self.epoch,
            mode=self.mode,
            endpoint=self.endpoint,
            strategy=self.strategy,
            num_workers=self.num_workers,
            metadata=self._metadata,
            wire_dtype=None if self.wire_dtype is None else dtype_name(self.wire_dtype),
            delta=self._stats.last_delta if self.delta else None,
            share_params=(
                None
                if not self.share_params
                else "unavailable: " + share_problem
                if share_problem
                else "on"
            ),
            uptime_s=now - self._started,
            host=socket.gethostname(),
            pid=os.getpid(),
            workers_total=counts["workers_total"],
            workers_live=counts["workers_live"],
            workers_shown=counts["workers_shown"],
            workers=workers,
            totals=totals,
            rank=None if self._rank is None else self._rank[0],
            ranks=None if self._rank is None else list(self.fleet.ranks),
            waiting_ranks=waiting,
        )

    def _copying(self) -> dict[Origin, int]:
        """The workers' peers that their hubs send copies to instead of shared memory
        (they hold blocks they did not let go of), with the blocks each pins."""
        return {
            Origin(runner.index, peer): pinned
            for runner in self._runners
            if isinstance(runner.hub, Lends)
            for peer, pinned in runner.hub.copying().items()
        }

    def _waiting_ranks(self) -> dict[str, list[int]] | None:
        """A rank's send under way: by rank, the workers that still wait for its part
        (holding the condition); None for an unsharded sender."""
        if self._rank is None:
            return None
        pending = self._pending
        if pending is None:
            return {}
        send = pending.send
        by_rank: dict[str, list[int]] = {}
        for w, parts in sorted(self.fleet.waiting_for(send.missing, send.version).items()):
            for r in parts:
                waiters = by_rank.setdefault(str(r), [])
                if len(waiters) < STATUS_ROWS:
                    waiters.append(w)
        return by_rank

    def connected_workers(self) -> frozenset[int]:
        """Ids of the workers that said hello and have not left (never cut short, unlike
        :meth:`status`'s rows)."""
        with self._cond:
            return frozenset(w for w, s in self.fleet.workers.items() if s.left is None)

    def worker_versions(self) -> dict[int, int]:
        """The newest version each worker acked in this sender's epoch, by worker id
        (0: none yet): every connected worker that has not left, and every expected
        worker ``0..num_workers-1`` (0 if it never connected or left).

        A worker whose transport knows it is gone (a broken pipe, a dead Ray actor)
        counts as left. Unlike :meth:`status`, never cut short: one entry per worker.
        """
        lost = {r.index: lost_peers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.acked_versions(lost)

    def current_workers(self) -> frozenset[int]:
        """Ids of the workers known to hold the latest version (what ``connect()`` and
        every later send gave them); before anything is published, every connected one."""
        lost = {r.index: lost_peers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.current(lost)

    # --- lifecycle -------------------------------------------------------------------

    def _holding_baton(self, hub: int = 0) -> Any:
        """Hold hub ``hub``'s baton: its transport may be used by this thread meanwhile."""
        return self._runners[hub].holding()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this sender is shut down")

    def close(self) -> None:
        """Stop the pump and close the transport. Idempotent; never waits on a peer."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        for runner in self._runners:
            runner.stop()
        for runner in self._runners:
            runner.hub.close()
        self._versions.serve(None)
        self._pending = None
