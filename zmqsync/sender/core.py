"""WeightSender: versions one model's weights and gets them to workers, acked.

The I/O shell around the fleet core (:mod:`zmqsync.fleet`), which decides everything
about the workers. Caller memory never reaches a transport: each chunk of a version is
copied into memory the sender owns (:mod:`.copying`) while the one before it is sent,
and each hub's stream keeps a window of chunks in its transport (:mod:`.pump`), written
again only once every transport let go of it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from zmqsync.chunking.delta import DeltaTracker
from zmqsync.chunking.layout import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, StreamLayout
from zmqsync.fleet import Fleet
from zmqsync.protocol import (
    MAX_CHUNK_BYTES,
    encode_metadata,
)
from zmqsync.sender.copying import Copying
from zmqsync.sender.handling import STALL_MEMORY, Handling
from zmqsync.sender.pump import HubRunner
from zmqsync.sender.reporting import LATENCY_BUCKETS, LATENCY_WINDOW, Reporting
from zmqsync.sender.transfers import Copy, Forwarding, Pending, Ring, Transfer
from zmqsync.sender.waiting import Waiting
from zmqsync.tensors.flatten import DEFAULT_PACK_THRESHOLD, Flattener
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.shared_params import SharedParams
from zmqsync.transport.base import (
    Announces,
    HubTransport,
    PeerId,
    ZeroCopy,
)
from zmqsync.vocabulary import Metadata, Strategy, WorkerIds

__all__ = ["WeightSender", "new_epoch"]

log = logging.getLogger("zmqsync.sender")


def new_epoch() -> int:
    """A random, non-zero 63-bit id for one life of a sender."""
    return secrets.randbits(63) | 1


class WeightSender(Copying, Waiting, Handling, Reporting):
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
            announced=[h.announce() if isinstance(h, Announces) else {} for h in hubs],
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
        self._ring = Ring(self.chunk_bytes)
        #: How long chunks usually take to be let go of (seconds, a moving average).
        self._release_time = 0.01
        self._last_stall = -STALL_MEMORY
        self._model_tensors = ModelTensors(strategy)
        self._snapshot: Copy | None = None
        self._snapshot_lock = threading.Lock()
        #: The model's tensors in a hub's shared memory (share_params), and why not.
        self._shared: SharedParams | None = None
        self._share_problem: str | None = None
        self._metadata: Metadata | None = None  # the latest version's
        self._pending: Pending | None = None
        #: A relay's version in progress (see _forward_begin), and its send.
        self._forwarding: Forwarding | None = None
        self._async_pending = False
        self._started = time.monotonic()
        self._last_expiry = self._started
        self._last_error_log = float("-inf")
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
            "message_errors": 0,
            "status_deferred": 0,
            "status_dropped": 0,
        }
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._closed = False
        self._pump_error: BaseException | None = None
        self._runners = [HubRunner(self, h, i) for i, h in enumerate(hubs)]
        for h in hubs:
            if isinstance(h, ZeroCopy):
                h.zero_copy_from(MIN_CHUNK_BYTES)  # chunks go from the sender's own memory
        for runner in self._runners:
            runner.start()
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
    def published_changed(self) -> bool:
        """Whether version 0, published without a copy (``retain_snapshot=False``), was
        found changed in place as a worker was served: it can no longer be sent."""
        snapshot = self._snapshot
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
            if self.retain_snapshot:
                copy = self._copy_of(weights, 0)
                if self.delta:
                    self._record(copy)
                copy.write_through(copy.count - 1)  # the weights may change once this returns
            else:
                copy = self._rendezvous(weights)
            with self._snapshot_lock:
                self._snapshot = copy  # kept until the first send
            with self._cond:
                self.fleet.published = True

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
        copy = self._copy_of(weights, version, whole=whole or self.retain_snapshot)
        copy.metadata = metadata
        self._metadata = metadata
        if self.delta:
            self._record(copy)
        with self._cond:
            send, peers = self.fleet.begin_send(worker_ids, time.monotonic(), self.timeout)
            pending = self._pending = Pending(send, copy)
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
                transfers = [Transfer(copy, None)]
            elif peers.get(runner.index):
                transfers = [Transfer(copy, list(peers[runner.index]))]
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

    # --- workers behind relays -------------------------------------------------------

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

    # --- the pumps ------------------------------------------------------------------

    def _holding_baton(self, hub: int = 0) -> Any:
        """Hold hub ``hub``'s baton: its transport may be used by this thread meanwhile."""
        return self._runners[hub].holding()

    # --- status & lifecycle ----------------------------------------------------------

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
