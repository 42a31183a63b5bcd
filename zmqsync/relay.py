"""A relay: a worker to its upstream, a sender to its own workers, holding no model.

Fleets of hundreds put relays between the learner and the workers, so that the learner
sends each version once per relay rather than once per worker. A relay forwards each
chunk to its workers as soon as it arrives (cut-through: a level of the tree adds about
a chunk's time), and acks a version upstream only once every worker it serves acked it:
the learner's ``send()`` still returns when the leaves hold the version, and a timeout
names the relay and, from its heartbeats, the workers behind it that lag.

By default it keeps the latest version it received whole, as its stream's bytes
(patched by deltas), for its late joiners and repairs: the Clone pattern one level down,
so that the learner never resends to everyone. With ``retain_snapshot=False`` it keeps
nothing but the chunks on their way, and fetches the latest version from upstream again
(once for all of them) when some of its workers need it. A relay may serve another
relay: trees of any depth.

Its upstream may be a sharded learner: its receiver then opens a session with every
rank (their endpoints come in rank 0's Welcome), gathers each version's parts, and the
relay forwards the whole version, cut into its own chunks, once every part is in (no
overlap of the ranks' streams with its own); its acks, refusals and the workers it
speaks for go to every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from zmqsync.chunking.layout import DEFAULT_CHUNK_BYTES, StreamLayout
from zmqsync.closing import ClosesOnExit
from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import MAX_BELOW, Chunk, WeightsSchema, encode
from zmqsync.protocol.stream import Broken
from zmqsync.receiver import PendingAck, ReceiverObserver, WeightReceiver
from zmqsync.security import CurveClient, CurveServer
from zmqsync.sender import WeightSender
from zmqsync.sender.transfers import Copy, Forwarded, ViewLease
from zmqsync.status_types import RelayCounts, SenderStatus, UpstreamStatus
from zmqsync.transport.base import HubTransport, SpokeTransport
from zmqsync.vocabulary import Mode, Strategy

__all__ = ["Relay"]

log = logging.getLogger("zmqsync.relay")

#: How often the relay's loop looks for its workers' acks while one is owed upstream.
ACK_POLL: Final = 0.002
#: How long its loop waits for upstream messages otherwise.
IDLE_POLL: Final = 0.05
#: A relay that keeps no snapshot asks upstream for the latest version again at most
#: this often (seconds), however many of its workers need it; the upstream limits its
#: answers too.
REFETCH_INTERVAL: Final = 1.0


class _Forwarder(ReceiverObserver):
    """What a relay does as its receiver takes each version: stage it apart from the
    snapshot served, forward each chunk as it comes, serve it once whole, and ack it
    upstream once its workers hold it; without a snapshot, fetch the latest again when a
    worker needs it. It owns that state, and uses its receiver and sender through their
    public calls (it is the receiver's observer, and the sender's ``on_unserved``)."""

    def __init__(
        self,
        receiver: WeightReceiver,
        sender: WeightSender,
        *,
        chunk_bytes: int,
        retain_snapshot: bool,
    ) -> None:
        self.receiver = receiver
        self.sender = sender
        self.chunk_bytes = chunk_bytes
        self.retain_snapshot = retain_snapshot
        #: An applied ack is owed upstream, until every worker below holds the version.
        self.owed = False
        self.stats = {
            "versions_forwarded": 0,
            "chunks_forwarded": 0,
            "aborted": 0,
            "refetches": 0,
        }
        #: The version being forwarded, if any.
        self._copy: Forwarded | None = None
        #: The snapshot served before the latest: its buffer stages the next version.
        self._spare: Copy | None = None
        #: The layout of the stream the relay holds, reused while the schema is the same.
        self._layout: StreamLayout | None = None
        #: The version under way comes whole at once (a sharded learner's, gathered):
        #: it is forwarded, in chunks of its own, once it is complete.
        self._gathered = False
        #: What else reads the buffer of the snapshot served (and of the one before,
        #: the spare): the chunks of gathered versions forwarded out of it, while a
        #: transport holds them.
        self._serving_leases: list[ViewLease] = []
        self._spare_leases: list[ViewLease] = []
        #: Some worker needs the latest version, which it does not keep (set by its
        #: sender's pump, read by the relay's loop).
        self._wants_latest = False
        #: It asked upstream for the latest version again (when), and says it is torn
        #: until the version comes or REFETCH_INTERVAL passes.
        self._refetching = False
        self._refetched_at = -REFETCH_INTERVAL

    # --- the relay's loop --------------------------------------------------------------

    def settle(self) -> None:
        """Send the ack owed upstream once every worker below holds its version."""
        if self.owed and self._settled(self.receiver.version):
            self.owed = False
            self.receiver.send_ack()

    def unserved(self) -> bool:
        """Without a snapshot (its sender's pump): a worker needs the latest version. On
        its way: the relay fetches it (a worker that connects waits for it)."""
        self._wants_latest = True
        return True

    def refetch(self) -> None:
        """Without a snapshot: ask upstream for the latest version again if a worker
        needs it (once per REFETCH_INTERVAL, for all of them)."""
        now = time.monotonic()
        if self._refetching and now - self._refetched_at >= REFETCH_INTERVAL:
            self._refetching = False  # unanswered: the next need asks again
        if not self._wants_latest or self._refetching:
            return
        self._wants_latest = False
        self._refetching = True
        self._refetched_at = now
        self.stats["refetches"] += 1
        self.receiver.request_latest()

    def stop(self) -> None:
        """The relay closes: the version under way goes no further."""
        if self._copy is not None:
            self.sender.abort_forward(self._copy)
            self._copy = None

    # --- the receiver's observer, on the relay loop's thread ---------------------------

    def version_starting(self, chunk: Chunk) -> None:
        """A version starts: stage it apart from the buffer served, which a late joiner or
        a repair may read until the version is whole (what is served as v is v's bytes),
        in the buffer of the snapshot before once nothing reads it (two buffers in all)."""
        snapshot, staging = self.sender.snapshot, self.receiver.staging
        if snapshot is None or not staging.nbytes or snapshot.data is not staging.array:
            return  # what staging holds is served to nobody
        spare, self._spare = self._spare, None
        leases, self._spare_leases = self._spare_leases, []
        # Its buffer is free once neither the sender nor a forwarded chunk reads it.
        unread = all(lease.released for lease in leases)
        free = None
        if spare is not None and unread and not self.sender.still_read(spare):
            free = spare.data
        # A delta patches the version held: it goes on from a copy of its bytes.
        staging.hand_over(free, keep=chunk.base is not None)

    def version_started(self, chunk: Chunk) -> None:
        # If it raises, the receiver drops the version: without its first chunk, the
        # version is asked for again (never staged without being forwarded).
        self.stop()
        receiver = self.receiver
        self._gathered = bool(receiver.ranks) and chunk.count == 1
        if self._gathered:
            chunk = self._head(chunk)  # what its own chunks will say
        if (chunk.version, chunk.epoch) == (receiver.version, receiver.epoch):
            # The version it holds, fetched again: for its workers that lack it.
            lacking = self.sender.lacking(chunk.version)
            if lacking:
                self._copy, _ = self.sender.begin_forward(chunk, targets=lacking)
            return
        # A newer version, or (restart) the one it forwards, streamed again upstream.
        self._copy, restart = self.sender.begin_forward(chunk)
        if not restart:
            self.owed = False  # a newer version supersedes the one owed
            self.stats["versions_forwarded"] += 1

    def chunk_arrived(self, chunk: Chunk) -> None:
        # Before the receiver stages it: cut-through.
        copy = self._copy
        if copy is None or self._gathered:
            return  # a gathered version goes once complete, from memory of the relay's
        schema_bytes = None
        if chunk.first:
            schema_bytes = self._layout_of(chunk).schema_bytes
        self.sender.forward_chunk(copy, chunk.index, encode(chunk, schema_bytes=schema_bytes))
        self.stats["chunks_forwarded"] += 1

    def version_completed(self, chunk: Chunk, schema: WeightsSchema) -> None:
        """The version (laid out as ``schema``) is whole in the staging buffer: serve it
        to late joiners."""
        self._refetching = False
        receiver = self.receiver
        if not self.retain_snapshot:
            if self._gathered and self._copy is not None:
                # The gather's buffer takes the next version: what is sent on is a copy
                # of its own, let go of once sent.
                self._forward_whole(chunk, np.frombuffer(chunk.payload, np.uint8).copy())
            self._copy = None
            return
        layout = self._layout
        if layout is None or layout.schema is not schema:
            layout = self._layout = StreamLayout.received(schema, self.chunk_bytes)
        data = receiver.staging.array
        leases: list[ViewLease] = []
        if self._gathered and self._copy is not None:
            leases.append(self._forward_whole(chunk, data))  # read from the snapshot's
        old = self.sender.serve_whole(receiver.version, layout, data, receiver.metadata)
        if old is not None and old.data is not data:
            self._spare = old  # nothing stages into it while it may be served
            self._spare_leases, self._serving_leases = self._serving_leases, leases
        else:  # the first served, or the same buffer again (a version fetched again)
            self._serving_leases = [x for x in self._serving_leases if not x.released] + leases
        self._copy = None

    def version_broken(self, broken: Broken) -> None:
        if self._copy is not None:
            self.stop()
            self.stats["aborted"] += 1

    def review_ack(self, ack: PendingAck) -> PendingAck | None:
        if ack.applied:
            version = self.receiver.version
            if not self._settled(version):
                self.owed = True  # acked once every worker below holds it
                return None
            # Its workers' refusals go up as its own: the learner's send then raises
            # WeightsRejected naming them, as for workers of its own.
            refused = self.sender.forward_refusals(version, self.receiver.worker_idx)
            if refused:
                return dataclasses.replace(ack, applied=False, reason=refused)
        return ack

    def below(self) -> dict[str, Any]:
        """Its workers and the version each holds, and those behind its own relays (so
        that a send upstream may target any of them)."""
        return self.sender.below(MAX_BELOW)

    def wants_resend(self) -> bool:
        # While it fetches the latest version again, it says it holds none whole: the
        # upstream then sends it (see refetch).
        return self._refetching

    # --- its own -------------------------------------------------------------------------

    def _settled(self, version: int) -> bool:
        """Whether every worker an ack upstream waits for holds ``version``: those it
        was forwarded to (its targets, when it came with some), else every live one."""
        return self.sender.forward_settled(version, self.receiver.epoch)

    def _head(self, chunk: Chunk) -> Chunk:
        """The first of the relay's own chunks of ``chunk``, a whole version in one (a
        gathered one): its chunks are the relay's ``chunk_bytes``, so its workers take
        them as any version (a chunk's size stays within the protocol's limit)."""
        layout = self._layout_of(chunk)
        offset, length = layout.span(0)
        return dataclasses.replace(
            chunk, count=layout.count, payload=memoryview(chunk.payload)[offset : offset + length]
        )

    def _forward_whole(self, chunk: Chunk, data: np.ndarray) -> ViewLease:
        """Send on the gathered version ``chunk`` names, whole in ``data``, in the relay's
        chunks; returns the lease that says while a transport holds any of them."""
        copy = self._copy
        assert copy is not None
        layout = self._layout_of(chunk)
        lease = ViewLease()
        for index in range(layout.count):
            offset, length = layout.span(index)
            first = index == 0
            piece = dataclasses.replace(
                chunk,
                index=index,
                count=layout.count,
                offset=offset,
                payload=data[offset : offset + length].data,
                schema=chunk.schema if first else None,
                metadata=chunk.metadata if first else None,
                targets=chunk.targets if first else None,
                checksum=0,
            )
            frames = encode(piece, schema_bytes=layout.schema_bytes if first else None)
            self.sender.forward_chunk(copy, index, lease.lend(frames).frames)
            self.stats["chunks_forwarded"] += 1
        return lease

    def _layout_of(self, chunk: Chunk) -> StreamLayout:
        layout = self._layout
        if layout is None or layout.schema is not chunk.schema:
            assert chunk.schema is not None
            layout = StreamLayout.received(chunk.schema, self.chunk_bytes)
            if layout.layout != chunk.layout:
                raise SchemaMismatchError("the schema does not encode to its own digest")
            self._layout = layout
        return layout


class Relay(ClosesOnExit):
    """Forwards one model's versions from ``upstream`` (a learner's or another relay's
    spoke) to the workers of ``hub`` (see the module).

    Args:
        upstream: the spoke it receives through; the relay owns and closes it.
        hub: the hub its workers connect to (or several); owned and closed by it.
        model_id: the model, as the learner names it.
        strategy: ``"tensordict"`` or ``"state_dict"``, as the learner's.
        worker_idx: its id among the upstream's workers (None: the upstream picks one).
        num_workers: its workers ``0..num_workers-1`` that an ack upstream waits for;
            None: every live worker.
        timeout: seconds ``connect()`` waits for the upstream's latest version.
        heartbeat: its workers' heartbeat (and its own, upstream: the upstream's).
        chunk_bytes: the chunks its late joiners and repairs are sent in.
        failover: makers of spokes to other upstreams, followed in turn when this one
            goes silent (see ``WeightReceiver``).
        retain_snapshot: keep the latest version whole (twice the model's size: the next
            is staged apart) for late joiners and repairs; False: keep only the chunks on
            their way, and fetch the latest again from upstream (which must keep one).
        connect_rank: makes a spoke to another rank of a sharded learner upstream (rank
            0's Welcome names their endpoints): it then gathers every rank's part of each
            version, and forwards it whole (see the module). ``over_zmq`` passes one.
    """

    def __init__(
        self,
        upstream: SpokeTransport,
        hub: HubTransport | Sequence[HubTransport],
        *,
        model_id: str = "policy",
        strategy: Strategy = "tensordict",
        worker_idx: int | None = None,
        num_workers: int | None = None,
        timeout: float = 10.0,
        heartbeat: float = 1.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        failover: Sequence[Callable[[], SpokeTransport]] = (),
        retain_snapshot: bool = True,
        connect_rank: Callable[[str], SpokeTransport] | None = None,
    ) -> None:
        self.model_id = model_id
        self.chunk_bytes = chunk_bytes
        self.retain_snapshot = retain_snapshot
        # Its two halves move the same model the same way.
        model: dict[str, Any] = {"model_id": model_id, "strategy": strategy, "timeout": timeout}
        # The relay keeps the snapshot (or none), not its sender: see
        # _Forwarder.version_completed.
        self.sender = WeightSender(
            hub,
            retain_snapshot=False,
            num_workers=num_workers,
            heartbeat=heartbeat,
            chunk_bytes=chunk_bytes,
            **model,
        )
        # Its receiver applies versions to nothing but its staging buffer (or keeps
        # nothing), and tells the relay of each chunk as it comes.
        self.receiver = WeightReceiver(
            upstream,
            keep="bytes" if retain_snapshot else "nothing",
            model_id=model_id,
            strategy=strategy,
            worker_idx=worker_idx,
            timeout=timeout,
            failover=failover,
            connect_rank=connect_rank,
        )
        self._forwarder = _Forwarder(
            self.receiver, self.sender, chunk_bytes=chunk_bytes, retain_snapshot=retain_snapshot
        )
        self.receiver.add_observer(self._forwarder)
        if not retain_snapshot:
            self.sender.on_unserved = self._forwarder.unserved
        #: What it forwarded: versions, chunks, aborted versions, refetches.
        self.stats = self._forwarder.stats
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def over_zmq(
        cls,
        upstream: str,
        endpoint: str | None = None,
        *,
        mode: Mode = "pubsub",
        curve_server: CurveServer | None = None,
        curve_client: CurveClient | None = None,
        insecure: bool = False,
        failover: Sequence[str] = (),
        **options: Any,
    ) -> Relay:
        """A relay between ZeroMQ endpoints: it connects to ``upstream`` (a learner's or a
        relay's endpoint, with ``curve_client`` keys) and listens on ``endpoint`` (None:
        a private ipc path) in ``mode`` (``"pubsub"`` or ``"router"``, with
        ``curve_server`` keys); ``failover``: other upstreams' endpoints, followed in
        turn when this one goes silent. A sharded learner's other ranks are reached the
        same way (with the same keys) as its Welcome names them. ``options`` go to
        :class:`Relay`."""
        from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke
        from zmqsync.transport.zmq_router import RouterHub

        if mode not in ("pubsub", "router"):
            raise ValueError(f"mode must be 'pubsub' or 'router'; got {mode!r}")
        name = options.get("worker_idx")
        identity = f"relay{'' if name is None else name}"
        spoke = PubSubSpoke(upstream, identity=identity, curve=curve_client)
        options["failover"] = [
            functools.partial(PubSubSpoke, e, identity=identity, curve=curve_client)
            for e in [*failover, upstream]
            if failover
        ]
        options.setdefault(
            "connect_rank", functools.partial(PubSubSpoke, identity=identity, curve=curve_client)
        )
        try:
            hub_cls = PubSubHub if mode == "pubsub" else RouterHub
            hub = hub_cls(endpoint, curve=curve_server, insecure=insecure)
        except BaseException:
            spoke.close()
            raise
        return cls(spoke, hub, **options)

    # --- public ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """Where its workers connect."""
        return self.sender.endpoint

    @property
    def version(self) -> int:
        """The latest version it holds whole."""
        return self.receiver.version

    def connect(self, timeout: float | None = None) -> None:
        """Join the upstream and receive its latest version (see ``WeightReceiver.connect``)."""
        self.receiver.connect(timeout)

    def start(self) -> None:
        """Serve in a background thread (after :meth:`connect`)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"zmqsync-relay-{self.model_id}", daemon=True
            )
            self._thread.start()

    def status(self) -> dict[str, Any]:
        """Its sender's status (its workers), with where it stands upstream: the fields
        of :meth:`report`, as ``report().as_dict()``."""
        return self.report().as_dict()

    def report(self) -> SenderStatus:
        """Its sender's report (its workers), with ``upstream`` (where it stands there)
        and ``relay`` (what it forwarded)."""
        receiver = self.receiver
        return dataclasses.replace(
            self.sender.report(),
            upstream=UpstreamStatus(
                worker=receiver.worker_idx,
                version=receiver.version,
                epoch=receiver.epoch,
                ack_owed=self._forwarder.owed,
                receiver=dict(receiver.stats),
            ),
            relay=RelayCounts(**self.stats),
        )

    def close(self) -> None:
        """Stop serving and close both ends (never waits on a dead peer)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._forwarder.stop()
        self.receiver.close()
        self.sender.close()

    # --- the loop --------------------------------------------------------------------

    def _run(self) -> None:
        receiver, forwarder = self.receiver, self._forwarder
        while not self._stop.is_set():
            try:
                receiver.poll(ACK_POLL if forwarder.owed else IDLE_POLL)
                forwarder.settle()
                forwarder.refetch()
            except Exception:
                if self._stop.is_set() or receiver.closed:
                    return
                log.exception("relay %s: its loop failed; going on", self.model_id)
                time.sleep(IDLE_POLL)
