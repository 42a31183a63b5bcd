"""WeightReceiver: a worker's end. Receives versions, validates, applies, acks.

A receiver holds ``(epoch, version)``: versions of its sender's epoch only go up;
duplicates and stale versions are ignored and counted; a new epoch (a restarted sender)
is followed, and frames of an epoch it has left are dropped. It holds two parts and
drives them from its loop: the session with its upstream
(:class:`~zmqsync.receiver.session.UpstreamSession`) and the apply machinery
(:class:`~zmqsync.receiver.applying.Applier`); observers watch it take each version.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from zmqsync.chunking.parts import (
    Assembly,
    GatherEvent,
    Held,
    Lost,
    Placed,
    Refused,
    Skipped,
    Torn,
    Whole,
)
from zmqsync.chunking.slices import Rebaser
from zmqsync.chunking.staging import Staging
from zmqsync.errors import (
    FrameError,
    SchemaMismatchError,
    SyncTimeout,
    WeightsRejected,
    ZMQSyncError,
)
from zmqsync.protocol import Chunk, Message, decode
from zmqsync.protocol.stream import DEFAULT_GAP
from zmqsync.receiver.applying import APPLY_MODES, KEEPS, Applier, Keep
from zmqsync.receiver.lock import WeightsLock
from zmqsync.receiver.observer import Observers, PendingAck, ReceiverObserver
from zmqsync.receiver.ranks import RankSessions
from zmqsync.receiver.rejections import Rejections
from zmqsync.receiver.session import UpstreamSession
from zmqsync.receiver.stats import new_stats
from zmqsync.tensors.slices import SliceSpec, declare_slices
from zmqsync.transport.base import Borrows, SpokeTransport, has_input
from zmqsync.transport.shm.records import Ask, RecordError, Written, is_record
from zmqsync.transport.shm.records import decode as decode_record
from zmqsync.vocabulary import Metadata, Strategy

__all__ = ["WeightReceiver"]

log = logging.getLogger("zmqsync.receiver")

#: Epochs a receiver remembers having left, to drop their late frames.
RETIRED_EPOCHS: Final = 16
#: connect() repeats an unanswered hello, probe or snapshot request after FIRST_RETRY
#: seconds, doubling up to RETRY_INTERVAL (a new subscription takes a few ms to be live).
FIRST_RETRY: Final = 0.005
RETRY_INTERVAL: Final = 0.2
#: A worker of a sharded learner waits on rank 0's spoke this long at a time while a
#: version is under way, and looks at the other ranks' spokes in between; idle, the
#: wait doubles up to RANK_POLL_IDLE (a version's first part wakes it at once if it
#: comes from rank 0, at most that much later if from another rank).
RANK_POLL: Final = 0.002
RANK_POLL_IDLE: Final = 0.02
#: Messages read from one rank's spoke before the next rank's is looked at.
RANK_DRAIN: Final = 64


class WeightReceiver:
    """Receives versions of one model and applies them to ``model`` in place.

    Args:
        spoke: the transport's worker end; the receiver owns and closes it.
        model_id: the model this worker holds.
        model: what received weights are applied to (``nn.Module``, ``TensorDict`` or
            ``dict`` of tensors); ``None`` keeps the latest weights in :attr:`weights`.
        strategy: must match the sender's.
        worker_idx: this worker's id, unique in the fleet; ``None`` asks the sender to
            assign one when connecting (a fleet scaled by replicas has no ids to hand out).
        timeout: default seconds for :meth:`connect`, and for a forward pass waiting on
            a torn model (:class:`WeightsLock`).
        apply_mode: ``"staged"``, ``"in_place"`` or ``"auto"``: staged for versions of
            several chunks up to :data:`STAGED_MAX_BYTES` that do not come through
            shared memory, in place otherwise (see the module). ``"shared"``: on the
            learner's host, the model's tensors become read-only views of the one copy
            of each version in shared memory, re-pointed under :attr:`lock` (no copy;
            see docs/shared.md).
        chunk_timeout: seconds between two chunks of a version before its stream counts
            as broken; with lent tensors, between its go (or the learner's latest word
            that it is still writing) and the learner's word that the version is in.
        failover: makers of spokes to other upstreams (relays, or the learner itself;
            the first upstream's again at the end, to come round to it), tried in
            turn when the upstream goes silent (nothing heard for
            :data:`FAILOVER_HEARTBEATS` heartbeats, at least :data:`FAILOVER_MIN_SECONDS`):
            the worker says hello there, keeping the version it holds, and is caught up.
        sink: instead of a model, a callable (an inference engine's ``load_weights``)
            called with each chunk's complete tensors as a list of ``(name, tensor)``
            (names dotted, as the learner's strategy spells them; each tensor in its own
            dtype, a view valid during the call: copy what you keep). The version is
            acked once the last call returned; a call that raises refuses the version,
            with the exception's text in the ack.
        keep: without a model or sink, what to keep of each version: ``"weights"``
            (:attr:`weights`), ``"bytes"`` (only its stream's bytes, in :attr:`staging`:
            a relay's snapshot) or ``"nothing"`` (its chunks only pass by the observers;
            a delta goes by whenever its base is the version held).
        connect_rank: makes a spoke to another endpoint: a sharded learner's rank that
            its rank 0's Welcome names (a scheme passes it). Without it, a worker
            follows a learner of one rank only.
        slices: what a tensor-parallel worker holds of each tensor: a callable
            ``(name, shape) -> Box | None`` (``shape``: the model's tensor, the slice's
            extent; ``Box(global shape, offsets)``: where the slice lies in the global
            tensor; None: the whole tensor), or a mapping of names to boxes (to ``(Box,
            extent)`` with a sink). Each rank of a sharded learner then sends this
            worker only the bytes of its part inside them, and versions are applied
            into the slices (or a sink is handed them). Worked out from the model once,
            here; it needs a sharded learner.
        lend_tensors: on the learner's host (pipes, ZeroMQ over ``ipc://``, Ray), once
            a version is whole in the model, move its tensors into memory lent to the hub
            (they stay the objects they were, private and writable), so that the sender
            (unless given ``lend_tensors=False``) writes later versions straight into
            them, under this worker's lock: one copy per version, where the stream takes
            two (the learner's into shared memory, this worker's out of it). By default
            (None) for versions of 4 MiB and more, the ones the sender writes; ``True``
            for any; ``False`` never. See :mod:`zmqsync.receiver.lent`.
    """

    def __init__(
        self,
        spoke: SpokeTransport,
        *,
        model_id: str = "policy",
        model: Any = None,
        strategy: Strategy = "tensordict",
        worker_idx: int | None = 0,
        timeout: float = 10.0,
        apply_mode: str = "auto",
        chunk_timeout: float = DEFAULT_GAP,
        sink: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
        failover: Sequence[Callable[[], SpokeTransport]] = (),
        keep: Keep = "weights",
        connect_rank: Callable[[str], SpokeTransport] | None = None,
        slices: SliceSpec | None = None,
        lend_tensors: bool | None = None,
    ) -> None:
        if apply_mode not in APPLY_MODES:
            raise ValueError(f"apply_mode must be one of {APPLY_MODES}; got {apply_mode!r}")
        if sink is not None and (model is not None or not callable(sink)):
            raise ValueError("sink= is a callable that takes the place of a model: not both")
        if keep not in KEEPS:
            raise ValueError(f"keep must be one of {KEEPS}; got {keep!r}")
        if apply_mode == "shared" and (model is None or sink is not None or slices is not None):
            raise ValueError("apply_mode='shared' maps a model's tensors: give a model, no sink")
        if keep != "weights" and (model is not None or sink is not None):
            raise ValueError("keep= is for a receiver without a model or sink")
        self.model_id = model_id
        self.timeout = timeout
        self.stats: dict[str, Any] = new_stats()
        self._rejections = Rejections(self.stats)
        #: The reasons of the last messages it refused, latest last.
        self.rejections: deque[str] = self._rejections.recent
        self._observers = Observers()
        self._applier = Applier(
            self,
            model_id=model_id,
            model=model,
            strategy=strategy,
            apply_mode=apply_mode,
            sink=sink,
            keep=keep,
            chunk_timeout=chunk_timeout,
            timeout=timeout,
            stats=self.stats,
            rejections=self._rejections,
            observer=self._observers,
            retired_epochs=RETIRED_EPOCHS,
            lend_tensors=lend_tensors if slices is None else False,
        )
        self._upstream = UpstreamSession(
            self,
            spoke,
            model_id=model_id,
            strategy=strategy,
            worker_idx=worker_idx,
            failover=failover,
            stats=self.stats,
            rejections=self._rejections,
            observer=self._observers,
        )
        self._connect_rank = connect_rank
        declared = () if slices is None else declare_slices(slices, model, strategy)
        self._upstream.slices = declared
        #: A tensor-parallel worker's slices, onto which each part's schema is rebased.
        self._rebaser = Rebaser({s.key: s for s in declared}) if declared else None
        #: A sharded learner's ranks, once rank 0's Welcome named them.
        self._ranks: RankSessions | None = None
        #: The refusal pending when connect() began: it stands unless a version fits.
        self._stale_mismatch: tuple[int, SchemaMismatchError] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        # A worker process that ends without closing its receiver (torchrl's collector
        # workers simply return) still says goodbye as it exits, so that its learner
        # does not take a normal shutdown for a crash. Weakly held: it keeps no
        # receiver alive, and close() cancels it.
        self._at_exit = multiprocessing.util.Finalize(
            None, _close_at_exit, args=(weakref.ref(self),), exitpriority=10
        )

    # --- what it holds: the apply machinery's -------------------------------------

    @property
    def version(self) -> int:
        """The version held (0: none yet)."""
        return self._applier.version

    @property
    def epoch(self) -> int:
        """The sender's life the version held is of (0: none yet)."""
        return self._applier.epoch

    @property
    def weights(self) -> Any:
        """Without a model or sink: the latest weights received (``keep="weights"``)."""
        return self._applier.weights

    @property
    def metadata(self) -> Metadata | None:
        """What the learner attached to the version held now (``send(metadata=)``)."""
        return self._applier.metadata

    @property
    def wire_dtype(self) -> str | None:
        """The dtype the version held now travelled as (``wire_dtype``), or None."""
        return self._applier.wire_dtype

    @property
    def lock(self) -> WeightsLock:
        """Held while a version is copied into the model. Hold it during a forward pass
        to never see half of one."""
        return self._applier.lock

    @property
    def on_applied(self) -> list[Callable[[int, int], None]]:
        """Called as ``fn(epoch, version)`` after each version is applied, still under
        :attr:`lock` (so the model holds exactly that version while it runs): append."""
        return self._applier.on_applied

    @property
    def model(self) -> Any:
        """What received weights are applied to (may be replaced between versions)."""
        return self._applier.model

    @model.setter
    def model(self, model: Any) -> None:
        self._applier.model = model

    @property
    def apply_mode(self) -> str:
        """``"staged"``, ``"in_place"`` or ``"auto"`` (may be changed between versions)."""
        return self._applier.apply_mode

    @apply_mode.setter
    def apply_mode(self, mode: str) -> None:
        if mode not in APPLY_MODES:
            raise ValueError(f"apply_mode must be one of {APPLY_MODES}; got {mode!r}")
        self._applier.apply_mode = mode

    @property
    def sink(self) -> Callable[[list[tuple[str, torch.Tensor]]], Any] | None:
        """The callable that takes the place of a model, if any."""
        return self._applier.sink

    @property
    def strategy(self) -> str:
        """How the weights are laid out (``"tensordict"`` or ``"state_dict"``)."""
        return self._applier.strategy

    @property
    def staging(self) -> Staging:
        """The buffer a version is gathered in: without a model, with ``keep="bytes"``,
        it holds the version held, as its stream's bytes, until the next one starts."""
        return self._applier.staging

    @property
    def torn(self) -> bool:
        """Whether the model holds parts of two versions (an in-place stream broke), or
        an observer wants the version held again: either way it takes the next whole
        version, even the one it holds, and its heartbeats say so."""
        return self._applier.needs_whole()

    # --- who it is to the sender: the session's -----------------------------------

    @property
    def worker_idx(self) -> int | None:
        """This worker's id (None until the sender assigns one, when it picks them)."""
        return self._upstream.worker_idx

    @worker_idx.setter
    def worker_idx(self, worker_idx: int | None) -> None:
        self._upstream.worker_idx = worker_idx  # before connecting: who it says it is

    @property
    def transport(self) -> SpokeTransport:
        """The spoke it receives through (another after a failover)."""
        return self._upstream.spoke

    # --- observers ------------------------------------------------------------------

    def add_observer(self, observer: ReceiverObserver) -> None:
        """Tell ``observer`` of each version as it is taken, and let it review acks (see
        :class:`~zmqsync.receiver.ReceiverObserver`). Add observers before receiving."""
        self._observers.add(observer)

    @property
    def ranks(self) -> tuple[str, ...]:
        """The endpoints of the sharded learner's ranks whose parts it gathers (empty:
        its upstream sends whole versions). A gathered version is taken as one chunk."""
        return () if self._ranks is None else self._ranks.endpoints

    def _sessions(self) -> list[UpstreamSession]:
        """Its sessions upstream: every rank's of a sharded learner, else the one."""
        return [self._upstream] if self._ranks is None else self._ranks.sessions

    def send_ack(self) -> None:
        """Ack the version held to the upstream now (to every rank of a sharded
        learner), through the observers' review: what an observer that held an ack back
        calls once it may go."""
        with self._upstream.io_lock:
            for session in self._sessions():
                session.ack(PendingAck(applied=True))

    def request_latest(self, *, whole: bool = False) -> None:
        """Ask the upstream (every rank of a sharded learner, for its part) for its
        latest version now, as a heartbeat does, once joined (``whole``: not as a delta;
        whole anyway while :attr:`torn`)."""
        with self._upstream.io_lock:
            for session in self._sessions():
                session.ask_again(whole=whole)

    def connect(self, timeout: float | None = None) -> None:
        """Join the fleet and return with the latest version applied.

        Raises :class:`SyncTimeout` if no sender answers within ``timeout`` seconds, and
        :class:`SchemaMismatchError` if the sender's latest version does not fit the
        model (the model keeps its weights; the sender is told, and counts the refusal).
        """
        timeout = self.timeout if timeout is None else timeout
        with self._upstream.io_lock:
            self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        upstream, applier = self._upstream, self._applier
        deadline = time.monotonic() + timeout
        endpoint = getattr(upstream.spoke, "endpoint", "")
        device = applier.device_to_take()
        if device is not None and isinstance(upstream.spoke, Borrows):
            upstream.spoke.take_device(device)  # versions on its GPU come device to device
        upstream.new_attempt()
        upstream.welcomed = False  # welcomed anew: a new session for this attempt
        # A refusal from before this call stands unless a version that fits comes: a
        # sender that knows of it answers "up to date" instead of resending that version.
        self._stale_mismatch = applier.mismatch
        applier.sink_refused = None
        self._wait(
            deadline,
            lambda: upstream.welcomed,
            upstream.send_hello,
            f"no sender answered at {endpoint} within {timeout:g}s: is the learner running "
            "and the endpoint right?",
        )
        self._open_ranks()
        ranks = self._ranks
        if ranks is not None:
            for other in ranks.others:
                if not other.welcomed:
                    other.new_attempt()
            endpoint = ", ".join(ranks.endpoints)
            self._wait(
                deadline,
                ranks.welcomed,
                ranks.say_hello,
                f"not every rank of the learner ({endpoint}) answered within {timeout:g}s",
            )
            ranks.start_probes()
        upstream.start_probe()
        self._wait(
            deadline,
            lambda: upstream.probe_ok if ranks is None else ranks.probed(),
            upstream.send_probe if ranks is None else ranks.send_probes,
            f"the sender at {endpoint} answered but its fan-out never reached this worker "
            f"within {timeout:g}s (blocked data port?)",
        )
        for session in [upstream] if ranks is None else ranks.sessions:
            session.caught_up = False
        self._wait(
            deadline,
            lambda: upstream.caught_up if ranks is None else ranks.caught_up(),
            upstream.request_snapshot if ranks is None else ranks.request_snapshots,
            f"the sender at {endpoint} did not send its latest version within {timeout:g}s",
        )
        if applier.mismatch is not None:
            raise self._mismatch_error()
        if applier.sink_refused is not None:
            version, reason = applier.sink_refused
            raise WeightsRejected(
                f"this worker's sink refused version {version} of {endpoint or 'the sender'}: "
                f"{reason}",
                rejections={-1 if self.worker_idx is None else self.worker_idx: reason},
                version=version,
            )
        upstream.joined(time.monotonic())

    def _wait(
        self, deadline: float, done: Callable[[], bool], ask: Callable[[], None], message: str
    ) -> None:
        next_ask = 0.0
        interval = FIRST_RETRY
        while True:
            if self._closed:  # by another thread: it says goodbye once this returns
                raise ZMQSyncError("the receiver was closed while it connected")
            # Before done(): the sender answers "up to date" to a worker that refused its
            # latest version, and a worker caught up that way does not hold it.
            mismatch = self._applier.mismatch
            if (
                mismatch is not None
                and mismatch is not self._stale_mismatch
                and (self._upstream.session or time.monotonic() >= deadline)
            ):
                # Once welcomed: its rejected ack, sent then, tells the sender why.
                raise self._mismatch_error()
            if done():
                return
            refused = self._upstream.take_refusal()
            if refused:
                raise ZMQSyncError(f"the sender refused worker {self.worker_idx}: {refused}")
            now = time.monotonic()
            if now >= deadline:
                raise SyncTimeout(message)
            if now >= next_ask:
                ask()
                next_ask = now + interval
                interval = min(RETRY_INTERVAL, interval * 2)
            self._process(min(RETRY_INTERVAL, deadline - now, max(0.0, next_ask - now)))

    def _mismatch_error(self) -> SchemaMismatchError:
        """What connect() raises for the version refused: the tensors layer's reason (the
        offending key), with the version and where it came from."""
        assert self._applier.mismatch is not None
        version, exc = self._applier.mismatch
        endpoint = getattr(self._upstream.spoke, "endpoint", "")
        weights = f"the weights at {endpoint}" if endpoint else "the sender's weights"
        error = SchemaMismatchError(
            f"{weights} (version {version}) do not fit this worker's model: {exc}; "
            "build the model the learner's weights come from",
            key=exc.key,
        )
        error.__cause__ = exc
        return error

    def receive(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` seconds for a new version; apply it and return it.

        Returns the weights applied (a ``dict`` for ``state_dict``, a ``TensorDict`` for
        ``tensordict``; the model's own tensors when there is a model), or ``None`` if no
        new version came in time. ``timeout=None`` waits up to the receiver's timeout.
        """
        if self._thread is not None:
            raise RuntimeError("a background receiver is running: it receives for you")
        return self._receive(self.timeout if timeout is None else timeout)

    def _receive(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        before = (self.epoch, self.version)
        while True:
            remaining = deadline - time.monotonic()
            self._process(max(0.0, min(remaining, self._upstream.heartbeat)))
            if (self.epoch, self.version) != before:
                return self.current_weights()
            if remaining <= 0:
                return None

    def poll(self, timeout: float = 0.0) -> bool:
        """Handle whatever has arrived, waiting up to ``timeout`` seconds for something
        (none: not at all); True if a new version was applied."""
        before = (self.epoch, self.version)
        self._process(timeout)
        return (self.epoch, self.version) != before

    def current_weights(self) -> Any:
        """The weights held now: the model's, or the last received; with a sink, the
        version it was given last."""
        if self.model is not None:
            return self.model
        if self.sink is not None:
            return self.version
        return self.weights

    def _process(self, timeout: float) -> None:
        """Wait up to ``timeout`` for messages, then handle all that queued up.

        Of several queued versions only the newest is applied: a worker that fell behind
        skips straight to the latest.
        """
        with self._upstream.io_lock:
            if self._ranks is not None:
                self._process_ranks(self._ranks, timeout)
            else:
                self._process_locked(timeout)
        # A thread that loops (the background receiver, a relay) takes the lock again
        # at once: first the threads that asked for it meanwhile have their turn.
        self._upstream.io_lock.give_way()

    def _process_locked(self, timeout: float) -> None:
        upstream, applier = self._upstream, self._applier
        now = time.monotonic()
        if upstream.upstream_silent(now) and upstream.fail_over():
            applier.abandon("the upstream went silent")
        upstream.beat(now)
        frames = upstream.spoke.recv_frames(timeout)
        while True:
            if frames is not None:
                upstream.heard(time.monotonic())
                ack = None
                if is_record(frames):  # the hub's ask or word on the lent tensors
                    ack = self._on_lent_record(frames[0])
                    message = None
                else:
                    message = self._decode(frames)
                if isinstance(message, Chunk):
                    ack = self._on_chunk(message)
                    upstream.read(message, time.monotonic())  # a note, if chunks come slowly
                elif message is not None:
                    upstream.on_control(message)
                    if upstream.ranks and self._open_ranks():
                        return  # a sharded learner's: its parts are gathered from now on
                # Let go of the frames before acking: a transport that lends its memory
                # (shared blocks) may reuse it by the time the sender sees the ack.
                frames = message = None
                if ack is not None:
                    upstream.ack(ack)
            if applier.active:
                # The middle of a version: wait for its next chunk (an in-place write
                # holds the model's lock until the last one). One that queued up came in
                # time; only when none did is the stream's gap checked (so a receiver
                # slowed down itself, on a loaded machine, does not break it).
                spoke = upstream.spoke
                upstream.beat(time.monotonic())  # still alive, still behind (when due)
                frames = spoke.recv_frames(0) if has_input(spoke) else None
                if frames is not None:
                    continue
                if applier.expire(time.monotonic()):
                    continue
                if timeout <= 0:
                    # A poll (a Ray actor's call delivers one chunk): the next chunk
                    # comes with a later call, and the stream's gap is checked then.
                    return
                frames = spoke.recv_frames(min(upstream.heartbeat, applier.gap))
                continue
            spoke = upstream.spoke
            if frames is None and has_input(spoke):
                frames = spoke.recv_frames(0)  # anything more? asking first spares a read
            if frames is None:
                return

    # --- a sharded learner: a session per rank, its parts gathered -------------------

    def _open_ranks(self) -> bool:
        """Open a session with each rank that rank 0's Welcome named, unless opened
        already or there is one rank only; True if it opened them now."""
        endpoints = self._upstream.ranks
        if self._ranks is not None or len(endpoints) < 2:
            return False
        if self._connect_rank is None:
            raise ZMQSyncError(
                f"the learner is sharded over {len(endpoints)} ranks, and this receiver "
                "cannot reach them: build it with connect_rank= (a scheme does)"
            )
        self._ranks = RankSessions(
            self,
            self._upstream,
            endpoints,
            self._connect_rank,
            gap=self._applier.gap,
            place=self._place_parts,
            stats=self.stats,
            rejections=self._rejections,
            observer=self._observers,
        )
        return True

    def _place_parts(self, assembly: Assembly) -> Any:
        """Where a version's parts are written as they come: the model's tensors when
        the apply machinery takes it in place, else the gather's buffer (None)."""
        return self._applier.place_parts(assembly.schema, assembly.total)

    def _process_ranks(self, ranks: RankSessions, timeout: float) -> None:
        """:meth:`_process` for a sharded learner's worker: every rank's spoke read in
        turn, rank 0's waited on a little at a time."""
        deadline = time.monotonic() + timeout
        wait = RANK_POLL
        while True:
            now = time.monotonic()
            ranks.tell_waiting()
            for session in ranks.sessions:
                session.beat(now)
            handled = False
            drained = True  # every rank's queue read to its end
            for index, session in enumerate(ranks.sessions):
                for _ in range(RANK_DRAIN):
                    frames = session.spoke.recv_frames(0)
                    if frames is None:
                        break
                    handled = True
                    self._on_rank_message(ranks, index, frames)
                else:
                    drained = False
            if drained:  # a chunk still queued came in time: gaps are checked once none is
                for event in ranks.gather.expire(time.monotonic()):
                    self._on_gathered(ranks, event)
            remaining = deadline - time.monotonic()
            if (handled and not ranks.gather.active) or remaining <= 0:
                return
            frames = ranks.sessions[0].spoke.recv_frames(min(remaining, wait))
            if frames is not None:
                self._on_rank_message(ranks, 0, frames)
            idle = frames is None and not handled and not ranks.gather.active
            wait = min(2 * wait, RANK_POLL_IDLE) if idle else RANK_POLL

    def _on_rank_message(self, ranks: RankSessions, index: int, frames: list[Any]) -> None:
        session = ranks.sessions[index]
        session.heard(time.monotonic())
        message = self._decode(frames)
        del frames
        if isinstance(message, Chunk):
            try:
                if self._rebaser is not None:
                    message = self._rebaser.chunk(message)
                events = ranks.gather.feed(
                    index,
                    message,
                    time.monotonic(),
                    (self.epoch, self.version),
                    self._applier.needs_whole(),
                )
            except FrameError as exc:
                self._rejections.add(self.worker_idx, f"rank {index}: {exc}")
                return
            session.read(message, time.monotonic())  # a note to that rank, if slow
            del message  # its bytes are in the gather's buffers now
            for event in events:
                self._on_gathered(ranks, event)
            ranks.gather.ready(index, time.monotonic())
        elif message is not None:
            session.on_control(message)

    def _on_gathered(self, ranks: RankSessions, event: GatherEvent) -> None:
        """Carry out what the gather of the parts calls for."""
        if isinstance(event, Whole | Placed):
            if isinstance(event, Whole):
                ack = self._on_chunk(event.chunk)  # the whole version, as one chunk
            else:
                ack = self._applier.parts_placed(event.chunk)  # written in place
                self._upstream.sender_epoch = self._applier.epoch
            if ack is not None:
                if ack.applied and event.delta:
                    self.stats["deltas"] += 1
                for session in ranks.sessions:
                    session.ack(ack)
                    session.caught_up = session.caught_up or ack.applied
        elif isinstance(event, Torn):
            self._applier.parts_torn(event.version, event.reason)
            for session in ranks.sessions:
                session.ask_again(whole=True)  # each rank's latest part repairs it
        elif isinstance(event, Held):
            self.stats["duplicates"] += 1
            session = ranks.sessions[event.part]
            session.ack(PendingAck(applied=True))
            session.caught_up = True
        elif isinstance(event, Refused):
            self._rejections.add(self.worker_idx, f"version {event.version}: {event.reason}")
            refusal = PendingAck(False, event.reason, event.version, event.epoch)
            for session in ranks.sessions:
                session.ack(refusal)
        elif isinstance(event, Lost):
            self.stats["broken_streams"] += 1
            ranks.sessions[event.part].ask_again(whole=True)
        elif isinstance(event, Skipped):
            self.stats["deltas_skipped"] += 1
            log.info(
                "worker %s: delta of part %s skipped: %s", self.worker_idx, event.part, event.reason
            )
            ranks.sessions[event.part].ask_again(whole=True)

    def _on_lent_record(self, frame: Any) -> PendingAck | None:
        """An :class:`Ask` or :class:`Written` from the hub, about the lent tensors."""
        applier = self._applier
        try:
            record = decode_record(frame)
        except RecordError:
            record = None
        if isinstance(record, Ask):
            applier.lent_ask(record.version, record.epoch, record.layout)
            return None
        if not isinstance(record, Written):
            self._rejections.add(self.worker_idx, "malformed record on the lent tensors")
            return None
        metadata = _metadata(record.metadata)
        epoch = applier.epoch
        ack = applier.lent_written(
            record.version, record.epoch, record.ok, metadata, record.unusable
        )
        if applier.epoch != epoch:
            self._upstream.sender_epoch = applier.epoch  # it follows a restarted sender
        if ack is not None and ack.applied:
            self._upstream.caught_up = True
        return ack

    def _on_chunk(self, chunk: Chunk) -> PendingAck | None:
        applier = self._applier
        epoch = applier.epoch
        ack = applier.feed(chunk)
        if applier.epoch != epoch:
            self._upstream.sender_epoch = applier.epoch  # it follows a restarted sender
        if ack is not None and ack.applied:
            self._upstream.caught_up = True  # it holds the version (or a newer one)
        return ack

    def _decode(self, frames: list[Any]) -> Message | None:
        try:
            message = decode(frames)
        except FrameError as exc:
            self._rejections.add(self.worker_idx, f"malformed message: {exc}")
            return None
        if message.model_id != self.model_id:
            self._rejections.add(
                self.worker_idx,
                f"message for model {message.model_id!r}; this worker holds {self.model_id!r}",
            )
            return None
        return message

    def start(self) -> None:
        """Receive in a background thread; new versions are applied under :attr:`lock`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"zmqsync-receiver-{self.worker_idx}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._process(0.05)
            except Exception:
                if self._closed:
                    return
                log.exception("background receiver of worker %s", self.worker_idx)
                time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background thread (waits at most ``timeout`` seconds)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Stop receiving and close the transport. Idempotent; never waits on a peer."""
        if self._closed:
            return
        self._at_exit.cancel()
        self.stop()
        self._closed = True
        self._applier.close()  # half a version in the model leaves it torn for good
        if self._ranks is not None:
            self._ranks.close()
        self._upstream.say_goodbye()
        self._upstream.spoke.close()


def _metadata(raw: bytes) -> dict[str, Any] | None:
    """A version's metadata as the hub's word on the lent tensors carries it (JSON of a
    dict), or None (none, or not such JSON)."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _close_at_exit(receiver: weakref.ref[WeightReceiver]) -> None:
    """Close a receiver still open as its process exits (its goodbye goes out)."""
    alive = receiver()
    if alive is not None:
        try:
            alive.close()
        except Exception:  # exiting: nothing to be done about it but say so
            log.debug("closing a receiver at exit failed", exc_info=True)
