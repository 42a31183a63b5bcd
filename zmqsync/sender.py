"""WeightSender: versions one model's weights and gets them to workers, acked.

The I/O shell around :class:`~zmqsync.fleet.Fleet`, which makes every decision about
the workers (sessions, claims, acks, repairs, expiry); this module moves bytes and waits.

Threads: the hub transport is owned by whoever holds the *baton* (a lock). A background
pump holds it almost always, reading acks and requests; ``send()`` asks for it (waking
the pump), hands the frames to the transport, gives it back, and waits for acks on a
condition the pump signals.

A version travels as a stream of chunks (:mod:`zmqsync.chunking`). Caller memory never
reaches a transport: chunk i is copied into memory the sender owns (the version's
stream, which late joiners and repairs are served from) and sent while chunk i+1 is
copied. Each stream to a hub is a :class:`_Transfer` with a window: at most
:data:`WINDOW` of its chunks are held by transports at once, so a transport's queues
never overflow however fast the sender writes. A stream's memory is written again only
once every transport has let go of it, so a worker that reads late (stopped, slow link)
still reads one whole version.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import secrets
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from zmqsync.chunking.delta import DELTA_BLOCK, DeltaTracker
from zmqsync.chunking.layout import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, Sources, StreamLayout
from zmqsync.errors import FrameError, SyncTimeout, TransportError, WeightsRejected
from zmqsync.fleet import FanOut, Fleet, Forget, Origin, Reply, Send, SendLatest
from zmqsync.protocol import (
    MAX_CHUNK_BYTES,
    Buffer,
    Chunk,
    ErrorMessage,
    Hello,
    Kind,
    StatusReply,
    StatusRequest,
    checksum,
    decode,
    encode,
    encode_metadata,
    peek_kind,
)
from zmqsync.status_types import LatencyHistogram, SenderStatus, Totals
from zmqsync.tensors.device_reader import DeviceReader
from zmqsync.tensors.extract import KeyPath, extract
from zmqsync.tensors.flatten import DEFAULT_PACK_THRESHOLD, Flat, Flattener
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.shared_params import SharedParams, why_not_shared
from zmqsync.tensors.views import dtype_name
from zmqsync.transport.base import HubTransport, Incoming, PeerId
from zmqsync.vocabulary import Strategy

__all__ = ["WeightSender"]

log = logging.getLogger("zmqsync.sender")

#: How long the pump waits for a message before looking at its timers.
PUMP_TICK: Final = 0.05
#: Latencies kept for the percentiles in status().
LATENCY_WINDOW: Final = 1000
#: What a worker may send to a sender; anything else is refused before it is decoded
#: (a weights message sent to a sender would otherwise be parsed and held for nothing).
ACCEPTED: Final = frozenset(
    {Kind.ACK, Kind.HELLO, Kind.SNAPSHOT_REQUEST, Kind.PROBE_REQUEST, Kind.GOODBYE}
)
#: Chunks of one transfer that transports may hold at once (queued, or on the wire).
#: Below every transport's queue limit for one peer (ZeroMQ's DATA_HWM), so none is
#: dropped for a peer that keeps up; enough that a chunk is always ready to go out.
WINDOW: Final = 4
#: Chunk buffers a sender without a snapshot keeps at most: the window's, and those
#: stopped peers pin until their transport queues are full (at the default 8 MiB
#: chunks, 256 MiB at worst, whatever the model's size).
RING_SLOTS: Final = 32
#: Transfers of the latest version to single workers (repairs, late joiners) at once;
#: a worker asking beyond it asks again at its next heartbeat.
MAX_REPAIRS: Final = 8
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
#: How long a transfer blocked on its window waits for transports before looking again.
WINDOW_WAIT: Final = 0.0005


#: Upper bounds (seconds) of the buckets sync latencies are counted in (and one more
#: bucket for the rest).
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


def new_epoch() -> int:
    """A random, non-zero 63-bit id for one life of a sender."""
    return secrets.randbits(63) | 1


class _Lease:
    """Tracks the views of sender-owned memory that were handed to transports.

    A transport that sends without copying keeps the view object until it let go of
    the bytes (pyzmq does, until ZeroMQ's I/O thread is done with the message), so a
    weak reference to each view says when nobody reads the memory any more.
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: list[weakref.ref[np.ndarray]] = []

    def lend(self, frames: Sequence[Buffer]) -> tuple[list[Any], list[weakref.ref[np.ndarray]]]:
        """``frames`` with every buffer after the header and body as a fresh view, and
        weak references to those views."""
        out: list[Any] = list(frames)
        refs = []
        for i in range(2, len(out)):
            view = np.frombuffer(out[i], dtype=np.uint8)
            ref = weakref.ref(view)
            refs.append(ref)
            out[i] = view
        self._refs.extend(refs)
        if len(self._refs) > 256:
            self._refs = [r for r in self._refs if r() is not None]
        return out, refs

    @property
    def released(self) -> bool:
        self._refs = [r for r in self._refs if r() is not None]
        return not self._refs


class _Ring:
    """Chunk-sized buffers a sender without a snapshot streams through, reused once no
    transport holds them: its whole extra memory, whatever the model's size.

    With ``alloc`` (a hub that lends shared memory), each chunk is written into a block
    the hub lends, and the hub's pool is the ring (it lends a block again once every
    worker released it); while every block is held, buffers of its own.
    """

    def __init__(self, chunk_bytes: int, alloc: Callable[[int], Any] | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self._alloc = alloc
        self._slots: list[tuple[np.ndarray, list[weakref.ref[np.ndarray]]]] = []

    def take(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes`` nobody holds, or None while every one is held."""
        if self._alloc is not None:
            lent = self._alloc(nbytes)
            if lent is not None:
                return lent
            # Every block the hub may lend is held (a stopped worker): through the
            # hub's socket, from buffers of our own, until blocks come free.
        for i, (slot, refs) in enumerate(self._slots):
            if all(r() is None for r in refs):
                self._slots[i] = (slot, [])
                return slot[:nbytes]
        if len(self._slots) >= RING_SLOTS:
            return None
        slot = np.empty(self.chunk_bytes, dtype=np.uint8)
        self._slots.append((slot, []))
        return slot[:nbytes]

    def hold(self, buffer: np.ndarray, refs: list[weakref.ref[np.ndarray]]) -> None:
        """``refs`` view ``buffer`` (a slot): it is not taken again until they are gone."""
        for slot, held in self._slots:
            if buffer.base is slot or buffer is slot:
                held.extend(refs)
                return

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot, _ in self._slots)


class _Copy:
    """One version's byte stream, as every transport sends it.

    Either whole (``data``: memory the sender owns, written chunk by chunk as it is
    first sent, kept as the snapshot), or through a :class:`_Ring` (each chunk written
    into a ring buffer as it is sent; nothing model-sized). Both read ``sources`` (the
    flattened weights), let go of once the copy is whole or its send is over.

    Or ``live``: ``data`` is the model's own parameters, which live in shared memory
    (``share_params``): nothing is written, and nothing is sent once the send is over.
    """

    def __init__(
        self,
        sender: WeightSender,
        version: int,
        layout: StreamLayout,
        data: np.ndarray | None,
        flat: Flat | None,
        lent_by_hub: bool = False,
        ring: _Ring | None = None,
        live: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.version = version
        #: What the learner attached to the version (its first chunk carries it).
        self.metadata = metadata
        self.layout = layout
        self.data = data
        self.ring = ring
        self.lent_by_hub = lent_by_hub
        self.live = live
        #: The peers its chunks went to (None: a hub's every peer).
        self.reached: set[PeerId] | None = set()
        #: The version whose whole stream ``data`` held when this copy took it over
        #: (the previous snapshot's memory, reused), or None.
        self.holds: int | None = None
        self.lease = _Lease()
        self._model_id = sender.model_id
        self._epoch = sender.epoch
        self._checksums = sender.checksums
        self._flat: Flat | None = flat
        self._sources = layout.sources(flat) if flat is not None else None
        self._written = 0 if flat is not None else layout.count
        self._ended = False
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self.layout.count

    @property
    def nbytes(self) -> int:
        return self.layout.total

    @property
    def readable(self) -> bool:
        """Whether every chunk can still be sent (a ring or live copy reads the caller's
        tensors, only while its send lasts)."""
        return not self._ended and (self.data is not None or self._sources is not None)

    def write_through(self, index: int) -> None:
        """Make sure chunks ``0..index`` are written (whole copies only)."""
        if self._written > index or self.data is None:
            return
        with self._lock:
            while self._written <= index:
                assert self._sources is not None
                offset, length = self.layout.span(self._written)
                self.layout.write(self._written, self._sources, self.data[offset : offset + length])
                self._written += 1
            if self._written == self.layout.count:
                self._let_go()  # the caller's memory is read no more

    def write_chunks(self, indices: Iterable[int]) -> None:
        """Write only chunks ``indices``: ``data`` holds the others already (``holds``
        a version that differs from this one in those chunks alone)."""
        assert self.data is not None and self._sources is not None
        with self._lock:
            for index in indices:
                offset, length = self.layout.span(index)
                self.layout.write(index, self._sources, self.data[offset : offset + length])
            self._written = self.layout.count
            self._let_go()

    @property
    def sources(self) -> Sources | None:
        """What the chunks are written from, while they are still read."""
        return self._sources

    def end(self) -> None:
        """The send is over: a ring or live copy reads the caller's tensors no more."""
        if self.data is None or self.live:
            self._let_go()
            self._ended = True

    def _let_go(self) -> None:
        if isinstance(self._sources, DeviceReader):
            self._sources.close()  # no copy out of the caller's tensors is still running
        self._sources = self._flat = None

    def reach(self, to: Sequence[PeerId] | None) -> None:
        """Its chunks went to ``to`` (None: every peer)."""
        if to is None:
            self.reached = None
        elif self.reached is not None:
            self.reached.update(to)

    def delta_frames(
        self,
        index: int,
        spans: list[tuple[int, int]],
        base: int,
        targets: tuple[int, ...] | None = None,
    ) -> tuple[list[Any], list[weakref.ref[np.ndarray]]]:
        """Chunk ``index`` of the delta against ``base`` that carries ``spans`` (a whole
        copy, written: the sender records a version's digests once it is)."""
        assert self.data is not None and self._written == self.layout.count
        offset, length = spans[index]
        payload = self.data[offset : offset + length].data.toreadonly()
        chunk = Chunk(
            self._model_id,
            self.version,
            self._epoch,
            index,
            len(spans),
            offset,
            self.layout.total,
            self.layout.layout,
            payload,
            checksum=checksum(payload) if self._checksums else 0,
            metadata=self.metadata if index == 0 else None,
            base=base,
            targets=targets if index == 0 else None,
        )
        frames = encode(chunk, schema_bytes=self.layout.schema_bytes if index == 0 else None)
        return self.lease.lend(frames)

    def frames(
        self, index: int, targets: tuple[int, ...] | None = None
    ) -> tuple[list[Any], list[weakref.ref[np.ndarray]]] | None:
        """Chunk ``index`` as frames to send, lent afresh (and written first if need
        be); None while the ring has no free buffer. ``targets``: the workers behind a
        relay the version is for (the first chunk says so)."""
        layout = self.layout
        offset, length = layout.span(index)
        if self.data is not None:
            self.write_through(index)
            buffer = self.data[offset : offset + length]
        else:
            assert self.ring is not None and self._sources is not None
            taken = self.ring.take(length)
            if taken is None:
                return None
            layout.write(index, self._sources, taken)
            buffer = taken
        payload = buffer.data.toreadonly()
        chunk = Chunk(
            self._model_id,
            self.version,
            self._epoch,
            index,
            layout.count,
            offset,
            layout.total,
            layout.layout,
            payload,
            checksum=checksum(payload) if self._checksums else 0,
            metadata=self.metadata if index == 0 else None,
            targets=targets if index == 0 else None,
        )
        frames = encode(chunk, schema_bytes=layout.schema_bytes if index == 0 else None)
        lent = self.lease.lend(frames)
        if self.data is None:
            assert self.ring is not None
            self.ring.hold(buffer, lent[1])
        return lent


class _Forwarded:
    """A version as a relay receives it from upstream: each chunk's frames, sent on as
    they come (:meth:`frames` is None until chunk ``index`` arrived) and let go of once
    sent. Nothing of it is kept: the relay's snapshot serves repairs and late joiners.
    """

    data = None
    live = False

    def __init__(self, chunk: Chunk) -> None:
        self.version = chunk.version
        self.count = chunk.count
        self.nbytes = chunk.total
        self.metadata = chunk.metadata
        self.reached: set[PeerId] | None = set()
        self.lease = _Lease()
        self._frames: dict[int, list[Any]] = {}
        self._ended = False

    @property
    def readable(self) -> bool:
        return not self._ended

    def add(self, index: int, frames: list[Any]) -> None:
        if not self._ended:
            self._frames[index] = frames

    def end(self) -> None:
        """The upstream stream broke (or the relay closes): nothing more will come."""
        self._ended = True
        self._frames.clear()

    def reach(self, to: Sequence[PeerId] | None) -> None:
        if to is None:
            self.reached = None
        elif self.reached is not None:
            self.reached.update(to)

    def frames(self, index: int) -> tuple[list[Any], list[weakref.ref[np.ndarray]]] | None:
        frames = self._frames.pop(index, None)
        return None if frames is None else self.lease.lend(frames)


class _Transfer:
    """One version streaming to one hub: fanned out (``to=None``) or to given peers;
    whole, or (``spans``) as a delta against version ``base``."""

    def __init__(
        self,
        copy: _Copy | _Forwarded,
        to: list[PeerId] | None,
        spans: list[tuple[int, int]] | None = None,
        base: int = 0,
        workers: int = 0,
        targets: tuple[int, ...] | None = None,
    ) -> None:
        self.copy = copy
        #: The workers behind the relay it goes to that the version is for, if some.
        self.targets = targets
        self.to = to
        self.spans = spans
        self.base = base
        #: How many targeted workers a delta goes to (counted in status).
        self.workers = workers
        self.next = 0
        self.started = time.monotonic()

    def covers(self, copy: _Copy | _Forwarded, peer: PeerId) -> bool:
        """Whether it brings ``peer`` the whole ``copy`` (a delta may not do)."""
        return self.copy is copy and self.spans is None and (self.to is None or peer in self.to)

    @property
    def count(self) -> int:
        return self.copy.count if self.spans is None else len(self.spans)

    @property
    def nbytes(self) -> int:
        """Bytes it sends each of its peers."""
        return self.copy.nbytes if self.spans is None else sum(n for _, n in self.spans)

    def frames(self) -> tuple[list[Any], list[weakref.ref[np.ndarray]]] | None:
        if self.spans is None:
            if isinstance(self.copy, _Forwarded):
                return self.copy.frames(self.next)
            return self.copy.frames(self.next, self.targets)
        assert isinstance(self.copy, _Copy)
        return self.copy.delta_frames(self.next, self.spans, self.base, self.targets)

    @property
    def sent(self) -> bool:
        return self.next >= self.count


@dataclass
class _Pending:
    send: Send
    copy: _Copy = field(repr=False)


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
            tensors keep their identity (an optimizer holding them is unaffected). It
            needs one hub that lends shared memory (pipes, Ray actors on this host,
            ZeroMQ over ``ipc://``) and a model of contiguous CPU tensors with no tied
            entries; otherwise sends copy as usual, and ``status()`` says why. No
            snapshot is kept (``retain_snapshot`` is False): late joiners get the next
            version. Nothing may change the model's tensors while ``send()`` runs; if a
            worker may still be reading when it returns (a timeout, a stopped worker),
            the model moves to another block first, so that worker reads one whole
            version. ``send_async()`` copies, as without it.
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
        if delta and (share_params or not retain_snapshot):
            raise ValueError(
                "delta=True needs retain_snapshot=True and no share_params: a worker "
                "that cannot apply a delta is sent the whole version from the snapshot"
            )
        hubs = [hub] if isinstance(hub, HubTransport) else list(hub)
        if not hubs:
            raise ValueError("a sender needs at least one hub transport")
        self.model_id = model_id
        self.model = model
        self.strategy = strategy
        self.timeout = float(timeout)
        self.share_params = share_params
        self.retain_snapshot = retain_snapshot and not share_params
        self.heartbeat = heartbeat
        self.repair_after = repair_after
        self.mode = mode or "+".join(h.name for h in hubs)
        self.epoch = epoch if epoch is not None else new_epoch()
        self.fleet = Fleet(
            model_id,
            self.epoch,
            mode=self.mode,
            strategy=strategy,
            transports=[h.name for h in hubs],
            announced=[h.announce() for h in hubs],
            num_workers=num_workers,
            heartbeat=heartbeat,
            repair_after=repair_after,
        )
        self.chunk_bytes = int(chunk_bytes)
        self.checksums = checksums
        self._flattener = Flattener(strategy, pack_threshold=pack_threshold, wire_dtype=wire_dtype)
        self.wire_dtype = wire_dtype
        self.delta = delta
        self._tracker: DeltaTracker | None = None
        #: What the latest send sent as deltas (status()["delta"]).
        self._last_delta: dict[str, Any] | None = None
        self._layout: StreamLayout | None = None
        self._ring = _Ring(self.chunk_bytes)
        #: How long chunks usually take to be let go of (seconds, a moving average).
        self._release_time = 0.01
        self._last_stall = -STALL_MEMORY
        self._model_tensors = ModelTensors(strategy)
        self._snapshot: _Copy | None = None
        self._snapshot_lock = threading.Lock()
        #: The model's tensors in a hub's shared memory (share_params), and why not.
        self._shared: SharedParams | None = None
        self._share_problem: str | None = None
        self._metadata: dict[str, Any] | None = None  # the latest version's
        self._pending: _Pending | None = None
        #: A relay's version in progress (see _forward_begin), and its send.
        self._forwarding: tuple[Send, _Forwarded] | None = None
        self._async_pending = False
        self._started = time.monotonic()
        self._last_expiry = self._started
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        #: Every send's latency, counted in LATENCY_BUCKETS (cumulative: Prometheus's
        #: histogram), with their sum.
        self._latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._totals = {
            "versions_sent": 0,
            "bytes_sent": 0,
            "chunks_sent": 0,
            "stalls": 0,
            "params_moved": 0,
            "repairs_sent": 0,
            "repair_bytes": 0,
            "repairs_skipped": 0,
            "timeouts": 0,
            "deltas_sent": 0,
        }
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._closed = False
        self._pump_error: BaseException | None = None
        self._runners = [_HubRunner(self, h, i) for i, h in enumerate(hubs)]
        for h in hubs:
            h.zero_copy_from(MIN_CHUNK_BYTES)  # chunks go from the sender's own memory
        for runner in self._runners:
            runner.start()
        if model is not None:
            self.publish()

    # --- public API (seeds) ----------------------------------------------------------

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
        self,
        weights: Any = None,
        worker_ids: int | list[int] | None = None,
        *,
        metadata: dict[str, Any] | None = None,
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
        self,
        weights: Any = None,
        worker_ids: int | list[int] | None = None,
        *,
        metadata: dict[str, Any] | None = None,
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
        """
        with self._send_lock:
            self._check_open()
            if self.fleet.version > 0:
                raise RuntimeError("publish() is for the weights before the first send()")
            copy = self._copy_of(weights, 0)
            if self.delta:
                self._record(copy)
            copy.write_through(copy.count - 1)  # the weights may change once this returns
            with self._snapshot_lock:
                self._snapshot = copy  # kept until the first send, whatever retain_snapshot
            with self._cond:
                self.fleet.published = True

    # --- the send path ---------------------------------------------------------------

    def _start(
        self,
        weights: Any,
        worker_ids: int | list[int] | None,
        *,
        whole: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> _Pending:
        self._check_open()
        if metadata is not None:
            encode_metadata(metadata)  # refused before any work: not a dict, too large
        with self._cond:
            self.fleet.targets(worker_ids, time.monotonic())  # bad ids raise before any work
            version = self.fleet.version + 1
        # Without a snapshot, a synchronous send streams through the ring: it reads the
        # caller's tensors until it returns, and nothing model-sized is made.
        copy = self._copy_of(weights, version, whole=whole or self.retain_snapshot)
        copy.metadata = metadata
        self._metadata = metadata
        if self.delta:
            self._record(copy)
        with self._cond:
            send, peers = self.fleet.begin_send(worker_ids, time.monotonic(), self.timeout)
            pending = self._pending = _Pending(send, copy)
            holdings = self.fleet.holdings(send.targets) if self.delta else {}
            routes: dict[PeerId, tuple[int, ...]] = {}
            for relay, behind in send.routes.items():
                s = self.fleet.workers.get(relay)
                if s is not None and s.origin.peer is not None:
                    routes[s.origin.peer] = behind
        deltas: dict[int, tuple[int, int]] = {}  # base -> (workers, bytes each)
        for runner in self._runners:
            if self.delta:
                transfers = self._delta_transfers(
                    copy, runner, holdings.get(runner.index, []), worker_ids is None
                )
            elif worker_ids is None:
                transfers = [_Transfer(copy, None)]
            elif peers.get(runner.index):
                transfers = [_Transfer(copy, list(peers[runner.index]))]
            else:
                transfers = []
            if routes:
                transfers = self._routed(transfers, routes)
            for transfer in transfers:
                runner.begin(transfer)
                if transfer.spans is not None:
                    n, _ = deltas.get(transfer.base, (0, 0))
                    deltas[transfer.base] = (n + transfer.workers, transfer.nbytes)
        patched = sum(n for n, _ in deltas.values())
        unpatched = max(0, len(send.targets) - patched)
        self._totals["versions_sent"] += 1
        # Bytes each targeted worker is sent (at least one copy's worth when none is).
        self._totals["bytes_sent"] += sum(n * size for n, size in deltas.values()) + (
            copy.nbytes * (unpatched if unpatched or patched else 1)
        )
        if self.delta:
            self._totals["deltas_sent"] += 1 if deltas else 0
            self._last_delta = {
                "version": version,
                "bases": [
                    {"base": b, "workers": n, "bytes": size}
                    for b, (n, size) in sorted(deltas.items())
                ],
                "whole_to": unpatched,
            }
        return pending

    # --- a relay's end: versions that arrive from upstream, sent on as they come -----

    def _forward_begin(self, chunk: Chunk, targets: tuple[int, ...] | None = None) -> _Forwarded:
        """A relay: send ``chunk``'s version on to every worker as its chunks come, or
        to ``chunk.targets``, or (``targets``) to those that lack the version it holds."""
        again = targets is not None
        targets = chunk.targets if targets is None else targets
        copy = _Forwarded(chunk)
        with self._cond:
            if chunk.epoch != self.epoch:
                self.epoch = chunk.epoch  # the upstream's life, which workers follow
                with self._snapshot_lock:
                    self._snapshot = None  # of the life before: nobody gets it now
            send = self.fleet.begin_forward(
                chunk.version, chunk.epoch, time.monotonic(), self.timeout, targets, again=again
            )
            self._forwarding = (send, copy)
            self._metadata = chunk.metadata
            peers = self._peers_of(send.targets) if targets is not None else {}
        for runner in self._runners:
            if targets is None:
                runner.begin(_Transfer(copy, None))
            elif peers.get(runner.index):
                # Only to the workers (and relays) it is for: they filter it further.
                runner.begin(_Transfer(copy, peers[runner.index]))
        self._totals["versions_sent"] += 1
        self._totals["bytes_sent"] += copy.nbytes * max(1, len(send.targets))
        return copy

    def _forward(self, copy: _Forwarded, index: int, frames: list[Any]) -> None:
        """Chunk ``index`` of a forwarded version came: send it on now (cut-through)."""
        copy.add(index, frames)
        for runner in self._runners:
            with runner.holding():
                streaming = runner.advance()
            if streaming and runner._waiting:
                runner._poke()

    def _peers_of(self, workers: Iterable[int]) -> dict[int, list[PeerId]]:
        """Per hub, the peers of ``workers`` that have one (holding the condition)."""
        out: dict[int, list[PeerId]] = {}
        for w in workers:
            s = self.fleet.workers.get(w)
            if s is not None and s.origin.peer is not None and s.left is None:
                out.setdefault(s.origin.hub, []).append(s.origin.peer)
        return out

    def _routed(
        self, transfers: list[_Transfer], routes: dict[PeerId, tuple[int, ...]]
    ) -> list[_Transfer]:
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
                out.append(_Transfer(t.copy, rest, t.spans, t.base, len(rest) if t.spans else 0))
            for p in routed:
                each = 1 if t.spans is not None else 0
                out.append(_Transfer(t.copy, [p], t.spans, t.base, each, targets=routes[p]))
        return out

    def _serve(self, copy: _Copy) -> None:
        """A relay's whole copy of the latest version it received: what its late joiners
        and repairs get (it may be older than the version being forwarded)."""
        with self._snapshot_lock:
            self._snapshot = copy

    def _record(self, copy: _Copy) -> None:
        """Write a version whole and digest it (``delta``): which blocks it changed.

        The digests read the caller's tensors where they are plain CPU bytes; then only
        the chunks that changed are written into the previous snapshot's memory, when
        the copy took it over. Otherwise (casts, a GPU) the stream is written whole
        first and its bytes digested."""
        assert copy.data is not None
        tracker = self._tracker
        if tracker is None or tracker.layout is not copy.layout:
            # Blocks no larger than a chunk: a delta never moves more than a chunk for
            # a change of one byte.
            tracker = self._tracker = DeltaTracker(copy.layout, min(DELTA_BLOCK, self.chunk_bytes))
        layout, sources, latest = copy.layout, copy.sources, tracker.latest
        if sources is not None and layout.stretches(sources, 0, layout.total) is not None:

            def read(lo: int, hi: int) -> list[Buffer]:
                parts = layout.stretches(sources, lo, hi)
                assert parts is not None  # every source is plain bytes
                return parts

            tracker.record(copy.version, read)
            if copy.holds is not None and copy.holds == latest:
                copy.write_chunks(tracker.chunks_changed(copy.version))
            else:
                copy.write_through(copy.count - 1)
            return
        copy.write_through(copy.count - 1)
        data = memoryview(copy.data.data)
        tracker.record(copy.version, lambda lo, hi: (data[lo:hi],))

    def _delta_transfers(
        self,
        copy: _Copy,
        runner: _HubRunner,
        holdings: list[tuple[PeerId, int | None]],
        fan_out: bool,
    ) -> list[_Transfer]:
        """How ``copy`` goes to one hub's targeted peers (``holdings``: each with the
        version it holds whole, if any) with ``delta``: deltas where they can be
        applied, the whole version to the rest (``fan_out``: also to peers that are not
        targeted, as a send to every worker does)."""
        tracker = self._tracker
        assert tracker is not None
        known = [(peer, base) for peer, base in holdings if base is not None]
        if not known:
            return [_Transfer(copy, None if fan_out else [p for p, _ in holdings])]
        if runner.hub.fans_out or runner.hub.shares_memory():
            # One stream reaches every peer: one delta, against the oldest version held.
            groups = {min(base for _, base in known): [peer for peer, _ in known]}
        else:
            groups = {}
            for peer, base in known:
                groups.setdefault(base, []).append(peer)
        whole = [peer for peer, base in holdings if base is None]
        deltas = []
        for base, peers in sorted(groups.items()):
            spans = tracker.spans(base, self.chunk_bytes)
            if spans is None:
                whole += peers
            else:
                deltas.append((base, peers, spans))
        if fan_out and not whole and len(deltas) == 1 and runner.hub.fans_out:
            base, peers, spans = deltas[0]
            return [_Transfer(copy, None, spans, base, len(peers))]
        # Addressed, so that no worker is sent two streams of one version at once.
        transfers = [
            _Transfer(copy, peers, spans, base, len(peers)) for base, peers, spans in deltas
        ]
        if whole:
            transfers.append(_Transfer(copy, whole))
        return transfers

    def _copy_of(self, weights: Any, version: int, *, whole: bool = True) -> _Copy:
        """``weights`` (``None``: the model's), to be copied chunk by chunk as it is
        sent: into memory the sender owns (``whole``), or through the ring."""
        source = self.model if weights is None else weights
        tensors = (
            self._model_tensors.get(source)
            if source is not None
            else extract(None, self.strategy)  # raises: says what to pass
        )
        if not whole and self.share_params:
            if source is self.model:
                live = self._live_copy(tensors, version)
                if live is not None:
                    return live
            else:
                self._share_problem = "send() was given weights that are not the model's"
        # Tensors on a GPU stay there: each chunk is copied to the host as it is written.
        flat = self._flattener.flatten(tensors, stage=False)
        if self._layout is None or not self._layout.fits(flat, self.chunk_bytes):
            self._layout = StreamLayout(flat, self.chunk_bytes)
        shared = self._shared_runner()
        if not whole:
            with self._snapshot_lock:
                self._snapshot = None  # none is kept: let the last one go
            if shared is not None and len(self._runners) == 1:
                # Chunks written into blocks the hub lends, which workers copy out
                # while the next is written; the hub's pool bounds them.
                ring = _Ring(self.chunk_bytes, alloc=shared.hub.shared_buffer)
            else:
                ring = self._ring
            return _Copy(self, version, self._layout, None, flat, ring=ring)
        if shared is not None:
            # A hub whose workers read shared memory in place: the stream, written once
            # into memory it lent, IS the transfer (workers copy chunk i out while the
            # next one is written).
            with shared.holding():
                return self._own(version, flat, self._layout, alloc=shared.hub.shared_buffer)
        return self._own(version, flat, self._layout)

    def _live_copy(self, tensors: dict[KeyPath, Any], version: int) -> _Copy | None:
        """The version as the model's own tensors in shared memory (``share_params``),
        moved there first if need be; None if they cannot live there."""
        shared = self._shared
        if shared is None or not shared.holds(tensors):
            shared = self._share(tensors)
            if shared is None:
                return None
        with self._snapshot_lock:
            self._snapshot = None  # the published version 0, if still kept
        return _Copy(self, version, shared.layout, shared.data, None, lent_by_hub=True, live=True)

    def _share(self, tensors: dict[KeyPath, Any]) -> SharedParams | None:
        """Move the model's tensors into a block the hub lends (out of the one they are
        in, if any); None, and the reason kept for ``status()``, if they cannot move."""
        runner = self._shared_runner()
        owners = self._model_tensors.owners(self.model)
        old, self._shared = self._shared, None
        why = (
            "wire_dtype casts every version: the tensors are not the wire bytes"
            if self.wire_dtype is not None
            else "no single hub lends shared memory (workers on another host?)"
            if runner is None or len(self._runners) != 1
            else why_not_shared(tensors, owners)
        )
        if why is None:
            assert runner is not None and owners is not None
            flat = self._flattener.flatten(tensors)
            if self._layout is None or not self._layout.fits(flat, self.chunk_bytes):
                self._layout = StreamLayout(flat, self.chunk_bytes)
            with runner.holding():
                data = runner.hub.shared_buffer(self._layout.total)
            if data is None:
                why = "the hub has no shared-memory block free"
            else:
                self._shared = SharedParams(tensors, owners, flat, self._layout, data)
                self._totals["params_moved"] += 1
        if old is not None:
            old.release(owners or [], private=self._shared is None)
        if why is not None and why != self._share_problem:
            log.warning("share_params: sends copy the model's tensors (%s)", why)
        self._share_problem = why
        return self._shared

    def _shared_runner(self) -> _HubRunner | None:
        """The first hub that lends shared memory to send from, if any."""
        for runner in self._runners:
            if runner.hub.shares_memory():
                return runner
        return None

    def _own(
        self,
        version: int,
        flat: Flat,
        layout: StreamLayout,
        alloc: Callable[[int], Any] | None = None,
    ) -> _Copy:
        """Memory the sender owns for ``flat``'s stream (``alloc``: memory a hub lends)."""
        with self._snapshot_lock:
            old, self._snapshot = self._snapshot, None  # at most one kept copy at a time
        # The previous stream's memory is reused once no transport reads it any more
        # (fresh memory costs a page fault per page); else it is left to whoever still
        # holds it, and freed when they let go.
        data = None
        previous = old.version if old is not None and old.layout is layout else None
        if alloc is not None:
            data = alloc(layout.total)
        elif (
            old is not None
            and old.data is not None
            and not old.lent_by_hub
            and len(old.data) == layout.total
            and old.lease.released
        ):
            data = old.data
        old = None
        lent = data is not None and alloc is not None
        holds = None
        if data is None:
            data = np.empty(layout.total, dtype=np.uint8)
        elif alloc is None:
            holds = previous  # the previous snapshot's memory: its bytes, whole
        owned = _Copy(self, version, layout, data, flat, lent_by_hub=lent)
        owned.holds = holds
        if self.retain_snapshot or version == 0:
            with self._snapshot_lock:
                self._snapshot = owned
        return owned

    def _latest(self) -> _Copy | None:
        """The latest version's stream, or None if the sender keeps none."""
        version = self.fleet.version
        with self._snapshot_lock:
            snapshot = self._snapshot
            if snapshot is not None and (snapshot.version == version or self._forwarding):
                return snapshot  # a relay serves the latest it holds whole
            pending = self._pending
            if pending is not None and pending.copy.version == version and pending.copy.readable:
                return pending.copy
        return None

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
                    wait = WINDOW_WAIT if streaming else PUMP_TICK
                    incoming = runner.hub.recv_frames(min(remaining, wait))
                    idle = incoming is None and not streaming
                    while incoming is not None:
                        self._handle(incoming, runner)
                        if pending.done:
                            return
                        incoming = runner.hub.recv_frames(0)
            return
        with self._cond:
            while not pending.done and not self._closed and self._pump_error is None:
                remaining = pending.deadline - time.monotonic()
                if remaining <= 0 or self._missing_are_lost(pending):
                    break
                self._cond.wait(min(remaining, PUMP_TICK))

    def _lost(self, workers: Iterable[int]) -> set[int]:
        """Those of ``workers`` known to be gone: they said goodbye, or their transport
        knows they are gone for good."""
        lost = {r.index: r.hub.lost_peers() for r in self._runners}
        with self._cond:
            return self.fleet.gone(workers, lost)

    def _missing_are_lost(self, pending: Send) -> bool:
        """True when every worker still missing is known to be gone: waiting on is futile."""
        missing = pending.missing
        return bool(missing) and self._lost(missing) == missing

    def _finish(self, pending: _Pending) -> None:
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

    # --- the pumps ------------------------------------------------------------------

    def _holding_baton(self, hub: int = 0) -> Any:
        """Hold hub ``hub``'s baton: its transport may be used by this thread meanwhile."""
        return self._runners[hub].holding()

    def _pump_failed(self, exc: BaseException) -> None:
        if not self._closed:
            log.exception("zmqsync sender pump stopped", exc_info=exc)
            self._pump_error = exc
            with self._cond:
                self._cond.notify_all()

    def _refuse(self, runner: _HubRunner, peer: PeerId | None, code: str, reason: str) -> None:
        with self._cond:
            self.fleet.reject(reason)
        # Counted in status; not a warning each, or a flood of junk would flood the log.
        log.debug("rejected a message: %s", reason)
        if peer is not None:
            runner.hub.send_frames(
                encode(ErrorMessage(self.model_id, code, reason[:500])), to=[peer]
            )

    def _handle(self, incoming: Incoming, runner: _HubRunner) -> None:
        """One message from a hub: refuse what is never accepted unread, let the fleet
        core decide the rest, and carry out its effects."""
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
                reply = StatusReply(self.model_id, self.version, self.epoch, self.status())
                runner.hub.send_frames(encode(reply), to=[peer])
            return
        reserved = (
            {r.index: r.hub.reserved_workers() for r in self._runners}
            if isinstance(message, Hello)
            else None
        )
        with self._cond:
            effects = self.fleet.handle(
                message, Origin(runner.index, peer), time.monotonic(), reserved
            )
            if self._pending is not None:
                self._cond.notify_all()
        self._carry_out(effects, runner)

    def _carry_out(self, effects: Iterable[Any], runner: _HubRunner) -> None:
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
            elif isinstance(effect, Forget) and effect.origin.peer is not None:
                hub.peer_left(effect.origin.peer)

    def _unserved(self, effect: SendLatest, hub: HubTransport) -> None:
        """A worker needs the latest version and the sender keeps none: it is told so,
        and gets the next version."""
        assert effect.origin.peer is not None
        hub.send_frames(encode(effect.otherwise), to=[effect.origin.peer])

    def _released_after(self, seconds: float) -> None:
        """A chunk was let go of ``seconds`` after it was sent (an upper bound)."""
        self._release_time += 0.2 * (seconds - self._release_time)

    def _stall_limit(self) -> float:
        """How long a chunk may be held before its holder counts as stopped."""
        limit = min(STALL_MAX, max(STALL_MIN, STALL_FACTOR * self._release_time))
        if time.monotonic() - self._last_stall < STALL_MEMORY:
            return min(limit, max(STALL_KNOWN, 2 * self._release_time))
        return limit

    def _housekeeping(self, runner: _HubRunner) -> None:
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

    def free_worker_id(self) -> int:
        """The lowest worker id that no session holds and no hub reserves (a pipe's or
        an actor's index): what a worker that asks for an id gets."""
        reserved = {r.index: r.hub.reserved_workers() for r in self._runners}
        with self._cond:
            return self.fleet.free_worker_id(reserved)

    # --- status & lifecycle ----------------------------------------------------------

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
        lat = sorted(self._latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        with self._cond:
            workers, counts = self.fleet.status_rows(now)
            fleet_counters = dict(self.fleet.counters)
            reasons = list(self.fleet.reasons)
        totals = Totals(
            **self._totals,
            **fleet_counters,
            latency_p50_s=pct(0.5),
            latency_p90_s=pct(0.9),
            latency_p99_s=pct(0.99),
            latency_histogram=LatencyHistogram(
                le=list(LATENCY_BUCKETS),
                counts=list(self._latency_counts),
                sum_s=self._latency_sum,
            ),
            rejections=reasons,
            transport=_sum_counters(r.hub.counters() for r in self._runners),
        )
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
            delta=self._last_delta if self.delta else None,
            share_params=(
                None
                if not self.share_params
                else "unavailable: " + self._share_problem
                if self._share_problem
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
        )

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
        lost = {r.index: r.hub.lost_peers() for r in self._runners}
        with self._cond:
            return self.fleet.acked_versions(lost)

    def current_workers(self) -> frozenset[int]:
        """Ids of the workers known to hold the latest version (what ``connect()`` and
        every later send gave them); before anything is published, every connected one."""
        lost = {r.index: r.hub.lost_peers() for r in self._runners}
        with self._cond:
            return self.fleet.current(lost)

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
        self._snapshot = None
        self._pending = None


def _sum_counters(counters: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counters:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


class _HubRunner:
    """One hub, its baton and the pump thread that serves it.

    The hub's sockets are used by one thread at a time, the baton's holder. Between
    sends the pump serves the hub (hellos, snapshot requests, status, stray acks).

    Where the hub has descriptors to wait on (ZeroMQ's), the pump waits on them holding
    nothing, and takes the baton only to read what came: a sending thread takes the
    baton at once, with no thread to wake first (a wake-up and a hand-off cost more
    than a 1 MB send's own work on a busy 2-core machine). With one hub, the sending
    thread reads its acks itself, so the pump does not even wake for them; it picks up
    stray ones on its tick. Whoever lets go of the baton checks for input first and
    wakes the pump if any is waiting (the descriptors say "look again", not "a message
    is here", and the holder's own reads may have consumed that signal).

    Other hubs (pipes, Ray, memory) are served by a pump blocked in ``recv_frames``
    with the baton held; a sending thread then wakes it (``hub.wake()``) and it lets go.
    """

    def __init__(self, sender: WeightSender, hub: HubTransport, index: int) -> None:
        self.sender = sender
        self.hub = hub
        self.index = index
        self._baton = threading.Lock()
        self._owner: int | None = None
        self._wanted = 0
        self._free = threading.Condition()
        self._stopping = False
        self._waiting = False  # the pump waits on the hub's descriptors, not in recv_frames
        self._acks = True  # whether the pump wakes for acks (not when send() reads them)
        self._poke_r = self._poke_w = -1
        self.turns = 0  # how often the pump took the baton (tests: sends do not wake it)
        #: Effects of the fleet core meant for this hub, decided on another hub's thread.
        self.later: deque[Any] = deque()
        #: Versions streaming to this hub (the baton holder advances them), oldest first,
        #: and their chunks that the hub may still hold: (sent at, weak refs to views).
        self.transfers: deque[_Transfer] = deque()
        #: The last transfers sent whole, as (version, to, started, finished): a repair
        #: of what one just sent waits (no copy is kept alive by it).
        self.done: deque[tuple[int, list[PeerId] | None, float, float]] = deque(maxlen=MAX_REPAIRS)
        self.inflight: deque[tuple[float, list[weakref.ref[np.ndarray]]]] = deque()
        self._window_full = False  # whether the last advance() stopped at a full window
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-sender-{sender.model_id}-{hub.name}", daemon=True
        )

    def start(self) -> None:
        # One hub: the sending thread reads the acks (see WeightSender._await_acks).
        self._acks = len(self.sender._runners) > 1
        if self.hub.wait_handles(acks=self._acks) is not None:
            self._poke_r, self._poke_w = os.pipe()
            os.set_blocking(self._poke_r, False)
            os.set_blocking(self._poke_w, False)
            self._waiting = True
        self._thread.start()

    def begin(self, transfer: _Transfer) -> None:
        """Stream ``transfer``'s version to this hub, superseding older versions' streams
        (their workers are repaired by this one), and send what the window allows."""
        with self.holding():
            version = transfer.copy.version
            self.transfers = deque(t for t in self.transfers if t.copy.version >= version)
            self.transfers.append(transfer)
            streaming = self.advance()
        if streaming and self._waiting:
            self._poke()  # the pump streams the rest if this thread does not

    def repair(self, copy: _Copy, peer: PeerId) -> bool:
        """Stream ``copy`` to ``peer`` alone (holding the baton); False if the hub already
        streams it to that peer or streams too many repairs."""
        repairs = [t for t in self.transfers if t.to is not None and len(t.to) == 1]
        now = time.monotonic()
        if (
            len(repairs) >= MAX_REPAIRS
            or any(t.covers(copy, peer) for t in self.transfers)
            or any(
                version == copy.version
                and (to is None or peer in to)
                and now - finished < finished - started
                for version, to, started, finished in self.done
            )
        ):
            # Too many, or this version is on its way to the peer (still streaming, or
            # sent so lately that the peer may still be reading it: a worker asks while
            # a long version reaches it): it asks again if it must.
            return False
        self.transfers.append(_Transfer(copy, [peer]))
        return True

    def advance(self) -> bool:
        """Send the chunks the window allows (holding the baton); True while some
        transfer has chunks left to send."""
        sender = self.sender
        inflight = self.inflight
        now = time.monotonic()
        while self.transfers:
            while inflight and all(r() is None for r in inflight[0][1]):
                sent_at = inflight.popleft()[0]
                if self._window_full:
                    # Watched closely (the window was full): how long chunks take to go.
                    sender._released_after(now - sent_at)
            self._window_full = False
            if len(inflight) >= WINDOW:
                if now - inflight[0][0] <= sender._stall_limit():
                    self._window_full = True
                    return True
                inflight.popleft()  # held by a stopped peer: go on without it
                sender._totals["stalls"] += 1
                sender._last_stall = now
                continue
            transfer = self.transfers[0]
            if not transfer.copy.readable:
                self.transfers.popleft()  # a ring copy whose send is over
                continue
            lent = transfer.frames()
            if lent is None:
                self._window_full = True  # every ring buffer is held: wait as for the window
                return True
            frames, refs = lent
            if transfer.next == 0:
                transfer.copy.reach(transfer.to)
            self.hub.send_frames(frames, to=transfer.to)
            del frames  # what the hub keeps of them is what the window watches
            now = time.monotonic()
            inflight.append((now, refs))
            transfer.next += 1
            sender._totals["chunks_sent"] += 1
            if transfer.sent:
                self.transfers.popleft()
                if transfer.spans is None:  # a delta brings the version to some only
                    self.done.append((transfer.copy.version, transfer.to, transfer.started, now))
        return False

    def _poke(self) -> None:
        """Make the pump look at the hub now (thread-safe, never blocks)."""
        with contextlib.suppress(OSError):  # a full pipe already says it; closed: stopping
            os.write(self._poke_w, b"\0")

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        if self._owner == threading.get_ident():
            yield  # re-entrant: send() holds it from the first frame to the last ack
            return
        with self._free:
            self._wanted += 1
        if not self._waiting:
            self.hub.wake()  # the pump holds the baton while it waits: make it let go
        self._baton.acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            look = self._waiting and self._has_input()
            self._owner = None
            self._baton.release()
            with self._free:
                self._wanted -= 1
                if not self._wanted:
                    self._free.notify_all()
            if look:
                self._poke()

    def _has_input(self) -> bool:
        try:
            return self.hub.has_input(acks=self._acks)
        except Exception:  # a closing hub: let the pump find out
            return True

    def _run(self) -> None:
        try:
            if self._waiting:
                self._run_waiting()
                return
            while not self._stopping:
                with self._free:
                    while self._wanted and not self._stopping:
                        self._free.wait(PUMP_TICK)
                with self._baton:
                    if self._stopping:
                        break
                    self.turns += 1
                    self.sender._housekeeping(self)
                    streaming = self.advance()
                    incoming = self.hub.recv_frames(WINDOW_WAIT if streaming else PUMP_TICK)
                    while incoming is not None:
                        self.sender._handle(incoming, self)
                        if self._wanted:
                            break
                        incoming = self.hub.recv_frames(0)
        except BaseException as exc:
            if not self._stopping:
                self.sender._pump_failed(exc)

    def _run_waiting(self) -> None:
        """The pump of a hub with descriptors: wait holding nothing, then read it all."""
        poller = select.poll()
        poller.register(self._poke_r, select.POLLIN)
        watched: list[int] = []
        look = True  # read first: something may have come before the pump started
        while not self._stopping:
            with self._free:
                while self._wanted and not self._stopping:
                    self._free.wait(PUMP_TICK)
            if not look:
                # A tick reads everything, acks included; a stream goes on within a ms.
                poller.poll(1 if self.transfers else PUMP_TICK * 1000)
                with contextlib.suppress(OSError):
                    while os.read(self._poke_r, 4096):
                        pass
            with self._baton:
                if self._stopping:
                    break
                self.turns += 1
                self.sender._housekeeping(self)
                self.advance()
                look = False
                incoming = self.hub.recv_frames(0)
                while incoming is not None:
                    self.sender._handle(incoming, self)
                    if self._wanted:
                        look = True  # let the sender have it; read the rest after
                        break
                    incoming = self.hub.recv_frames(0)
                handles = self.hub.wait_handles(acks=self._acks) or []
            if handles != watched:
                for fd in watched:
                    with contextlib.suppress(KeyError):
                        poller.unregister(fd)
                watched = handles
                for fd in watched:
                    poller.register(fd, select.POLLIN)

    def stop(self) -> None:
        self._stopping = True
        with self._free:
            self._free.notify_all()
        if self._waiting:
            self._poke()
        else:
            self.hub.wake()
        self._thread.join(timeout=5)
        if self._waiting:
            for fd in (self._poke_r, self._poke_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._poke_r = self._poke_w = -1
