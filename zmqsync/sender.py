"""WeightSender: versions one model's weights and gets them to workers, acked.

Threads: the hub transport is owned by whoever holds the *baton* (a lock). A background
pump holds it almost always, reading acks and requests; ``send()`` asks for it (waking
the pump), hands the frames to the transport, gives it back, and waits for acks on a
condition the pump signals.

Late joiners and lost messages (ZeroMQ's Clone pattern): every worker asks for a
snapshot when it connects and again on each heartbeat, saying which version it holds.
A worker that is behind gets the latest version addressed to it, from a copy the sender
keeps (``retain_snapshot=True``), so it catches up without a resend to everyone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from zmqsync.errors import FrameError, SyncTimeout, TransportError, WeightsRejected
from zmqsync.protocol import (
    AUTO_WORKER,
    Ack,
    Buffer,
    ErrorMessage,
    Goodbye,
    Hello,
    Message,
    Probe,
    ProbeRequest,
    SnapshotRequest,
    StatusReply,
    StatusRequest,
    UpToDate,
    Weights,
    Welcome,
    decode,
    encode,
)
from zmqsync.tensors import DEFAULT_PACK_THRESHOLD, Flat, Flattener, ModelTensors, extract
from zmqsync.transport.base import HubTransport, Incoming, PeerId

__all__ = ["WeightSender", "WorkerInfo"]

log = logging.getLogger("zmqsync.sender")

#: How long the pump waits for a message before looking at its timers.
PUMP_TICK: Final = 0.05
#: Latencies kept for the percentiles in status().
LATENCY_WINDOW: Final = 1000
#: Rejection reasons kept per worker and for the sender itself.
REASONS_KEPT: Final = 8
#: A worker heard from within this many heartbeats is live: a fleet that is whoever
#: connected (``num_workers=None``) waits for it, and nobody else may take its id.
LIVE_HEARTBEATS: Final = 3


def new_epoch() -> int:
    """A random, non-zero 63-bit id for one life of a sender."""
    return secrets.randbits(63) | 1


@dataclass
class WorkerInfo:
    """What the sender knows of one worker (what ``status()`` reports)."""

    worker: int
    transport: str
    peer: PeerId | None = None
    pid: int = 0
    host: str = ""
    version: int = 0
    epoch: int = 0
    first_seen: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    last_ack: float | None = None
    last_latency: float | None = None
    received_bytes: int = 0
    rejected_frames: int = 0
    rejections: deque[str] = field(default_factory=lambda: deque(maxlen=REASONS_KEPT))
    last_repair: float = 0.0
    hub: int = 0
    entitled: int = 0  # the newest version a targeted send meant for this worker
    refused: tuple[int, int] = (0, 0)  # (epoch, version) it last rejected
    joining_to: int = 0  # said hello when this was the latest: it gets (at least) that
    session: str = ""  # the connect attempt its last Hello belonged to
    left: float | None = None  # when it said goodbye (None: it has not, or came back)


@dataclass
class _Pending:
    version: int
    targets: frozenset[int]
    started: float
    deadline: float
    frames: list[Buffer] = field(repr=False)
    flat: Flat = field(repr=False)
    acked: set[int] = field(default_factory=set)
    rejected: dict[int, str] = field(default_factory=dict)
    snapshot: concurrent.futures.Future[list[Buffer]] | None = None
    #: Targets chosen as "every live worker" (``num_workers=None``, no ``worker_ids``):
    #: a target that says goodbye meanwhile is no longer waited for.
    dynamic: bool = False

    @property
    def done(self) -> bool:
        return self.targets <= (self.acked | self.rejected.keys())

    @property
    def missing(self) -> set[int]:
        return set(self.targets - self.acked - self.rejected.keys())


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
        retain_snapshot: keep a copy of the latest version for late joiners and repairs
            (costs one model's worth of memory; without it a late joiner waits for the
            next send).
        heartbeat: seconds between workers' heartbeats (told to them in the Welcome).
        repair_after: a worker still behind this long after a version was sent to it
            gets it again, addressed.
    """

    def __init__(
        self,
        hub: HubTransport | Sequence[HubTransport],
        *,
        model_id: str = "policy",
        model: Any = None,
        strategy: str = "tensordict",
        num_workers: int | None = None,
        timeout: float = 10.0,
        retain_snapshot: bool = True,
        heartbeat: float = 1.0,
        repair_after: float = 1.0,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        mode: str = "",
        epoch: int | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds; got {timeout}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0; got {num_workers}")
        hubs = [hub] if isinstance(hub, HubTransport) else list(hub)
        if not hubs:
            raise ValueError("a sender needs at least one hub transport")
        self.model_id = model_id
        self.model = model
        self.strategy = strategy
        self.num_workers = num_workers
        self.timeout = float(timeout)
        self.retain_snapshot = retain_snapshot
        self.heartbeat = heartbeat
        self.repair_after = repair_after
        self.mode = mode or "+".join(h.name for h in hubs)
        self.epoch = epoch if epoch is not None else new_epoch()
        self.version = 0
        self._flattener = Flattener(strategy, pack_threshold=pack_threshold)
        self._model_tensors = ModelTensors(strategy)
        self._snapshot: tuple[int, list[Buffer], Flat] | None = None
        self._snapshot_lock = threading.Lock()
        self._snapshot_handed_out = False  # the snapshot's frames went to a transport
        self._pending: _Pending | None = None
        self._async_pending = False
        self._broadcast_version = 0  # the newest version sent to every worker
        self._workers: dict[int, WorkerInfo] = {}
        self._started = time.monotonic()
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._totals = {
            "versions_sent": 0,
            "bytes_sent": 0,
            "timeouts": 0,
            "rejected_frames": 0,
            "goodbyes": 0,
            "stray_goodbyes": 0,
        }
        self._reasons: deque[str] = deque(maxlen=REASONS_KEPT)
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._closed = False
        self._pump_error: BaseException | None = None
        self._snapshot_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._runners = [_HubRunner(self, h, i) for i, h in enumerate(hubs)]
        for h in hubs:
            h.zero_copy_from(pack_threshold)  # what is not packed goes from its own memory
        for runner in self._runners:
            runner.start()

    # --- public API (seeds) ----------------------------------------------------------

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

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Send weights and return once every targeted worker has applied them.

        ``weights``: ``None`` (extract from the model), an ``nn.Module``, a ``TensorDict``
        or a ``dict`` of tensors. ``worker_ids``: ``None`` (all), an ``int`` or a list.

        Raises :class:`SyncTimeout` (a ``TimeoutError``) naming the workers that did not
        ack within ``timeout``, or :class:`WeightsRejected` if some refused the version.
        The sender stays usable after either.
        """
        with self._send_lock:
            if self._async_pending:
                raise RuntimeError("a send_async() is still pending: call wait_async() first")
            # One hub: keep it from the first frame to the last ack (one thread handoff).
            with (
                self._runners[0].holding() if len(self._runners) == 1 else contextlib.nullcontext()
            ):
                pending = self._start(weights, worker_ids, wait=True)
                self._finish(pending)

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Start a send and return at once; :meth:`wait_async` completes it.

        Until then, do not change the weights in place: they are sent from their own
        memory (zero-copy). Raises ``RuntimeError`` if a previous send_async is pending.
        """
        with self._send_lock:
            if self._async_pending:
                raise RuntimeError(
                    "a send_async() is still pending: call wait_async() before the next send"
                )
            self._start(weights, worker_ids)
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

    # --- the send path ---------------------------------------------------------------

    def _targets(self, worker_ids: int | list[int] | None) -> frozenset[int]:
        if worker_ids is None:
            if self.num_workers is not None:
                return frozenset(range(self.num_workers))
            now = time.monotonic()
            with self._cond:
                return frozenset(w for w, info in self._workers.items() if self._live(info, now))
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        for w in ids:
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise ValueError(f"worker_ids must be non-negative ints; got {w!r}")
            if self.num_workers is not None and w >= self.num_workers:
                raise ValueError(
                    f"worker {w} does not exist: this sender has workers 0..{self.num_workers - 1}"
                )
        return frozenset(ids)

    def _start(
        self, weights: Any, worker_ids: int | list[int] | None, *, wait: bool = False
    ) -> _Pending:
        self._check_open()
        targets = self._targets(worker_ids)
        source = self.model if weights is None else weights
        tensors = (
            self._model_tensors.get(source)
            if source is not None
            else extract(None, self.strategy)  # raises: says what to pass
        )
        flat = self._flattener.flatten(tensors)
        version = self.version + 1
        shared = self._shared_runner() if self.retain_snapshot else None
        if shared is not None:
            # A hub whose workers read shared memory in place: the snapshot, written once
            # into memory it lent, IS the transfer (no copy of the model per send beyond it).
            with shared.holding():
                frames = self._take_snapshot(version, flat, alloc=shared.hub.shared_buffer)
        else:
            message = Weights(self.model_id, version, self.epoch, flat.schema, tuple(flat.buffers))
            frames = encode(message, schema_bytes=flat.schema_bytes)
        now = time.monotonic()
        pending = _Pending(
            version,
            targets,
            now,
            now + self.timeout,
            frames,
            flat,
            dynamic=worker_ids is None and self.num_workers is None,
        )
        with self._cond:
            self.version = version
            self._pending = pending
            peers: dict[int, list[PeerId]] = {}
            for i, w in self._workers.items():
                if i in targets and w.peer is not None:
                    peers.setdefault(w.hub, []).append(w.peer)
            if worker_ids is None:
                self._broadcast_version = version
            for i in targets & self._workers.keys():
                self._workers[i].last_repair = now
                self._workers[i].entitled = version
        # Encoded once above; every hub sends the same buffers.
        for runner in self._runners:
            with runner.holding():
                if worker_ids is None:
                    runner.hub.send_frames(frames)
                elif peers.get(runner.index):
                    runner.hub.send_frames(frames, to=peers[runner.index])
        self._totals["versions_sent"] += 1
        self._totals["bytes_sent"] += flat.nbytes * max(1, len(targets))
        if self.retain_snapshot and shared is None:
            # The copy that late joiners and repairs get runs beside the transfer (ZeroMQ's
            # I/O thread reads the model's memory meanwhile). A blocking send() copies on
            # this thread, which would only wait for acks otherwise (a handoff to another
            # thread costs more than a small copy on a busy machine); send_async() hands
            # it to a thread so that it returns at once. Either way it is done before the
            # caller may change its tensors again.
            if wait:
                self._take_snapshot(version, flat)
            else:
                pending.snapshot = self._snapshotter().submit(self._take_snapshot, version, flat)
        return pending

    def _snapshotter(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._snapshot_pool is None:
            self._snapshot_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"zmqsync-snapshot-{self.model_id}"
            )
        return self._snapshot_pool

    def _shared_runner(self) -> _HubRunner | None:
        """The first hub that lends shared memory to send from, if any."""
        for runner in self._runners:
            if runner.hub.shares_memory():
                return runner
        return None

    def _take_snapshot(
        self, version: int, flat: Flat, alloc: Callable[[int], Any] | None = None
    ) -> list[Buffer]:
        """Keep a copy of this version; ``alloc``: memory a hub lends to hold it (the
        copy is then sent, too). Returns the copy's frames."""
        with self._snapshot_lock:
            old, self._snapshot = self._snapshot, None  # at most one copy alive at a time
            # The previous copy's memory is reused unless it was ever handed to a
            # transport (a late joiner's or a repair's send may still read it).
            spare = old[2] if old is not None and not self._snapshot_handed_out else None
            self._snapshot_handed_out = False
        old = None  # a copy handed out is freed (here) before the new one is allocated
        # Lent memory comes back to the hub's pool once its workers let go of it.
        copy = flat.owned_copy(into=spare if alloc is None else None, alloc=alloc)
        message = Weights(self.model_id, version, self.epoch, copy.schema, tuple(copy.buffers))
        frames = encode(message, schema_bytes=copy.schema_bytes)
        with self._snapshot_lock:
            self._snapshot = (version, frames, copy)
            self._snapshot_handed_out = alloc is not None  # sent right after this
        return frames

    def _await_acks(self, pending: _Pending) -> None:
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
                    incoming = runner.hub.recv_frames(min(remaining, PUMP_TICK))
                    idle = incoming is None
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
        with self._cond:
            left = {w for w in workers if w in self._workers and self._workers[w].left is not None}
            where = {
                w: (self._workers[w].hub, self._workers[w].peer)
                for w in workers
                if w in self._workers and self._workers[w].peer is not None
            }
        lost = {i: self._runners[i].hub.lost_peers() for i in {h for h, _ in where.values()}}
        return left | {w for w, (h, peer) in where.items() if peer in lost[h]}

    def _missing_are_lost(self, pending: _Pending) -> bool:
        """True when every worker still missing is known to be gone: waiting on is futile."""
        missing = pending.missing
        return bool(missing) and self._lost(missing) == missing

    def _finish(self, pending: _Pending) -> None:
        try:
            self._await_acks(pending)
        finally:
            if pending.snapshot is not None:
                pending.snapshot.result()
        with self._cond:
            if self._pending is pending:
                self._pending = None
            missing = pending.missing
            rejected = dict(pending.rejected)
        if self._pump_error is not None:
            raise TransportError(
                f"the sender's transport failed: {self._pump_error}"
            ) from self._pump_error
        if missing:
            self._totals["timeouts"] += 1
            # Messages still queued for the missing workers point into weights the caller
            # may now change: drop them, so nobody ever applies a torn version. They catch
            # up from the snapshot on their next heartbeat.
            for runner in self._runners:
                with runner.holding():
                    runner.hub.purge()
            raise SyncTimeout(
                self._timeout_message(pending, missing),
                missing_workers=missing,
                version=pending.version,
                transports=self._transport_names(missing),
            )
        if rejected:
            details = "; ".join(f"worker {w}: {r}" for w, r in sorted(rejected.items()))
            raise WeightsRejected(
                f"version {pending.version} was rejected by {len(rejected)} worker(s): {details}",
                rejections=rejected,
                version=pending.version,
            )
        self._latencies.append(time.monotonic() - pending.started)

    def _transport_names(self, workers: Iterable[int]) -> dict[int, str]:
        with self._cond:
            return {
                w: (self._workers[w].transport if w in self._workers else self.mode)
                for w in workers
            }

    def _timeout_message(self, pending: _Pending, missing: set[int]) -> str:
        now = time.monotonic()
        parts = []
        with self._cond:
            for w in sorted(missing):
                info = self._workers.get(w)
                if info is None:
                    parts.append(f"worker {w} never connected")
                else:
                    parts.append(
                        f"worker {w} ({info.transport}, pid {info.pid or '?'}) holds version "
                        f"{info.version}, last heard {now - info.last_seen:.1f}s ago"
                    )
        gone = self._lost(missing)
        if gone:
            with self._cond:
                left = {w for w in gone if self._workers[w].left is not None}
            parts = [
                part
                + (
                    " (it said goodbye: its receiver closed)"
                    if w in left
                    else " (its transport says it is gone)"
                    if w in gone
                    else ""
                )
                for w, part in zip(sorted(missing), parts, strict=True)
            ]
        waited = "" if gone == missing else f" within {self.timeout:g}s"
        return (
            f"{len(missing)} worker(s) did not ack version {pending.version} of "
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

    def _reject(self, reason: str, worker: int | None = None) -> None:
        self._totals["rejected_frames"] += 1
        self._reasons.append(reason)
        if worker is not None and worker in self._workers:
            self._workers[worker].rejected_frames += 1
            self._workers[worker].rejections.append(reason)
        log.warning("rejected a message: %s", reason)

    def _reply(self, hub: HubTransport, peer: PeerId | None, message: Message) -> None:
        if peer is not None:
            hub.send_frames(encode(message), to=[peer])

    def _handle(self, incoming: Incoming, runner: _HubRunner) -> None:
        hub = runner.hub
        try:
            message = decode(incoming.frames)
        except FrameError as exc:
            self._reject(f"malformed message: {exc}")
            self._reply(
                hub, incoming.peer, ErrorMessage(self.model_id, "malformed", str(exc)[:500])
            )
            return
        if isinstance(message, StatusRequest):
            self._reply(
                hub,
                incoming.peer,
                StatusReply(self.model_id, self.version, self.epoch, self.status()),
            )
            return
        if message.model_id != self.model_id:
            reason = (
                f"message for model {message.model_id!r} reached the sender of {self.model_id!r}"
            )
            self._reject(reason)
            self._reply(hub, incoming.peer, ErrorMessage(self.model_id, "wrong-model", reason))
            return
        if isinstance(message, Goodbye):
            self._on_goodbye(message, runner, incoming.peer)
            return
        if isinstance(message, Hello) and message.worker == AUTO_WORKER:
            message = dataclasses.replace(message, worker=self._assign(incoming.peer))
        worker = getattr(message, "worker", None)
        if worker is not None and not self._claim(worker, runner, incoming.peer):
            reason = (
                f"worker id {worker} is already taken by a worker on {self._holder(worker)}: "
                "worker ids must be unique in a fleet"
            )
            self._reject(reason)
            self._reply(hub, incoming.peer, ErrorMessage(self.model_id, "duplicate-worker", reason))
            return
        if isinstance(message, Ack):
            self._on_ack(message)
        elif isinstance(message, Hello):
            self._on_hello(message, runner, incoming.peer)
        elif isinstance(message, SnapshotRequest):
            self._on_snapshot_request(message, runner, incoming.peer)
        elif isinstance(message, ProbeRequest):
            # Down the fan-out path: arriving proves the worker's subscription is live.
            hub.send_frames(encode(Probe(self.model_id, message.worker, message.nonce)))
        else:
            reason = f"unexpected {type(message).__name__} message at the sender"
            self._reject(reason)
            self._reply(hub, incoming.peer, ErrorMessage(self.model_id, "unexpected", reason))

    def free_worker_id(self) -> int:
        """The lowest worker id that no live worker holds and no hub reserves (a pipe's
        or an actor's index): what a worker that asks for an id gets."""
        now = time.monotonic()
        with self._cond:
            taken = {w for w, info in self._workers.items() if self._live(info, now)}
        for runner in self._runners:
            taken |= runner.hub.reserved_workers()
        return next(i for i in itertools.count() if i not in taken)

    def _assign(self, peer: PeerId | None) -> int:
        """An id for a worker that asked for one: its own again if it says hello twice,
        else :meth:`free_worker_id`."""
        with self._cond:
            for info in self._workers.values():
                if peer is not None and info.peer == peer:
                    return info.worker
        return self.free_worker_id()

    def _claim(self, worker: int, runner: _HubRunner, peer: PeerId | None) -> bool:
        """Record that ``worker`` speaks through this hub; False if another hub reserves
        that id, or another hub's worker still holds it (heard from within three
        heartbeats)."""
        now = time.monotonic()
        if any(
            worker in other.hub.reserved_workers() for other in self._runners if other is not runner
        ):
            return False
        with self._cond:
            info = self._workers.get(worker)
            if info is None:
                info = self._workers[worker] = WorkerInfo(worker, runner.hub.name, hub=runner.index)
            elif info.hub != runner.index:
                if self._live(info, now):
                    return False
                info.hub, info.transport, info.peer = runner.index, runner.hub.name, None
            info.last_seen = now
            if peer is not None:
                info.peer = peer
            return True

    def _live(self, info: WorkerInfo, now: float) -> bool:
        """Whether a worker counts as present: not gone, and heard from lately."""
        quiet = now - info.last_seen
        return info.left is None and quiet < LIVE_HEARTBEATS * max(self.heartbeat, 0.1)

    def _on_goodbye(self, bye: Goodbye, runner: _HubRunner, peer: PeerId | None) -> None:
        """A worker left: stop waiting for it. One that is not who it says it is (another
        hub's, another connection's or another connect attempt's) changes nothing."""
        with self._cond:
            info = self._workers.get(bye.worker)
            if (
                info is None
                or info.hub != runner.index
                or (peer is not None and info.peer is not None and peer != info.peer)
                or (bye.session and info.session and bye.session != info.session)
            ):
                self._totals["stray_goodbyes"] += 1
                return
            info.left = time.monotonic()
            self._totals["goodbyes"] += 1
            pending = self._pending
            if pending is not None and pending.dynamic and bye.worker in pending.targets:
                # "every live worker" no longer includes it
                pending.targets = pending.targets - {bye.worker}
            self._cond.notify_all()
        if peer is not None:
            runner.hub.peer_left(peer)

    def _holder(self, worker: int) -> str:
        """The transport that holds ``worker``'s id (for error messages)."""
        for runner in self._runners:
            if worker in runner.hub.reserved_workers():
                return runner.hub.name
        with self._cond:
            info = self._workers.get(worker)
        return info.transport if info is not None else "another transport"

    def _seen(self, worker: int) -> WorkerInfo:
        with self._cond:
            return self._workers[worker]

    def _on_hello(self, hello: Hello, runner: _HubRunner, peer: PeerId | None) -> None:
        info = self._seen(hello.worker)
        if not hello.session or hello.session != info.session:
            # A worker (re)connecting. A repeat of a Hello already handled (the worker
            # asks again until welcomed; over Ray several may arrive at once, late) only
            # gets its Welcome again: it must not rewind what the worker acked since, nor
            # earn it a repair of a version already on its way.
            info.session = hello.session
            info.left = None
            info.pid, info.host = hello.pid, hello.host
            info.last_repair = 0.0  # a (re)connecting worker may have its snapshot at once
            # It may hold another model now (a restarted worker), or be asking again
            # whether the latest fits: either way it must see the latest, not "up to date".
            info.refused = (0, 0)
            info.joining_to = self.version
            if hello.epoch == self.epoch:
                info.version = hello.version
        announced = runner.hub.announce()
        self._reply(
            runner.hub,
            peer,
            Welcome(
                self.model_id,
                self.version,
                self.epoch,
                mode=self.mode,
                strategy=self.strategy,
                data_endpoint=str(announced.get("data_endpoint", "")),
                ack_endpoint=str(announced.get("ack_endpoint", "")),
                heartbeat_seconds=self.heartbeat,
                worker=hello.worker,
            ),
        )

    def _on_snapshot_request(
        self, request: SnapshotRequest, runner: _HubRunner, peer: PeerId | None
    ) -> None:
        info = self._seen(request.worker)
        fresh = (
            request.epoch != self.epoch or request.version == 0 or request.version < info.joining_to
        )
        behind = fresh or request.version < self.version
        # A worker left out of a targeted send stays behind (worker_ids means exactly
        # those workers); one that is joining (connect) gets the latest version.
        meant = fresh or max(info.entitled, self._broadcast_version) >= self.version
        if request.epoch == self.epoch:
            info.version = max(info.version, request.version)
        # A worker that refused this very version would only refuse it again.
        refused = info.refused == (self.epoch, self.version)
        now = time.monotonic()
        frames = self._latest_frames() if behind and meant and not refused else None
        if frames is not None and now - info.last_repair >= self.repair_after:
            info.last_repair = now
            runner.hub.send_frames(frames, to=[peer] if peer else None)
            return
        in_flight = frames is not None  # sent to it within repair_after: on its way
        self._reply(runner.hub, peer, UpToDate(self.model_id, self.version, self.epoch, in_flight))

    def _latest_frames(self) -> list[Buffer] | None:
        with self._snapshot_lock:
            snapshot = self._snapshot
            if snapshot is not None and snapshot[0] == self.version:
                self._snapshot_handed_out = True  # never to be overwritten now
                return snapshot[1]
        pending = self._pending
        if pending is not None and pending.version == self.version:
            return pending.frames  # still owned by the sender until this send completes
        return None

    def _on_ack(self, ack: Ack) -> None:
        now = time.monotonic()
        info = self._seen(ack.worker)
        with self._cond:
            info.pid, info.host = ack.pid or info.pid, ack.host or info.host
            info.received_bytes = ack.received_bytes
            info.rejected_frames = max(info.rejected_frames, ack.rejected_frames)
            if ack.epoch == self.epoch and ack.applied:
                info.version = max(info.version, ack.version)
                if info.version >= info.joining_to:
                    info.joining_to = 0
                info.epoch = ack.epoch
                info.last_ack = now
            if not ack.applied:
                info.rejections.append(ack.reason)
                info.refused = (ack.epoch, ack.version)
            pending = self._pending
            if pending is not None and ack.worker in pending.targets and ack.epoch == self.epoch:
                if ack.applied and ack.version >= pending.version:
                    if ack.worker not in pending.acked:
                        info.last_latency = now - pending.started
                    pending.acked.add(ack.worker)
                    pending.rejected.pop(ack.worker, None)
                elif not ack.applied and ack.version == pending.version:
                    pending.rejected[ack.worker] = ack.reason
                if pending.done:
                    self._cond.notify_all()

    # --- status & lifecycle ----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The sync state as a JSON-ready dict (what ``zmqsync status`` shows)."""
        now = time.monotonic()
        lat = sorted(self._latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        with self._cond:
            expected = set(range(self.num_workers)) if self.num_workers is not None else set()
            workers: list[dict[str, Any]] = []
            for w in sorted(expected | self._workers.keys()):
                info = self._workers.get(w)
                if info is None:
                    workers.append(
                        {
                            "worker": w,
                            "connected": False,
                            "live": False,
                            "left": False,
                            "expected": True,
                            "version": 0,
                            "lag": self.version,
                        }
                    )
                    continue
                version = info.version if info.epoch in (self.epoch, 0) else 0
                workers.append(
                    {
                        "worker": w,
                        "connected": True,
                        "live": self._live(info, now),
                        "left": info.left is not None,
                        "since_left_s": None if info.left is None else now - info.left,
                        "expected": w in expected,
                        "transport": info.transport,
                        "host": info.host,
                        "pid": info.pid,
                        "version": version,
                        "lag": max(0, self.version - version),
                        "since_last_ack_s": None if info.last_ack is None else now - info.last_ack,
                        "since_last_seen_s": now - info.last_seen,
                        "last_latency_s": info.last_latency,
                        "received_bytes": info.received_bytes,
                        "rejected_frames": info.rejected_frames,
                        "rejections": list(info.rejections),
                    }
                )
        return {
            "model_id": self.model_id,
            "version": self.version,
            "epoch": self.epoch,
            "mode": self.mode,
            "endpoint": self.endpoint,
            "strategy": self.strategy,
            "num_workers": self.num_workers,
            "uptime_s": now - self._started,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "workers": workers,
            "totals": {
                **self._totals,
                "latency_p50_s": pct(0.5),
                "latency_p90_s": pct(0.9),
                "latency_p99_s": pct(0.99),
                "rejections": list(self._reasons),
                **_sum_counters(r.hub.counters() for r in self._runners),
            },
        }

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
        if self._snapshot_pool is not None:
            self._snapshot_pool.shutdown(wait=True)
        self._snapshot = None


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
                    incoming = self.hub.recv_frames(PUMP_TICK)
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
                poller.poll(PUMP_TICK * 1000)  # a tick reads everything, acks included
                with contextlib.suppress(OSError):
                    while os.read(self._poke_r, 4096):
                        pass
            with self._baton:
                if self._stopping:
                    break
                self.turns += 1
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
