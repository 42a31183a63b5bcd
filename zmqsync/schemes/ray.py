"""RayWeightSyncScheme: weight sync with Ray actors, through Ray's object store.

torchrl's scheme of the same name on zmqsync's Ray transport (:mod:`zmqsync.transport.ray`):
a version is put into the object store once, each actor copies it into its model as
the sender's calls arrive (between its other methods), and the calls' results are the
acks. An actor that dies makes ``send()`` raise :class:`~zmqsync.SyncTimeout` naming it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

from zmqsync.errors import SchemaMismatchError, SyncTimeout
from zmqsync.receiver import WeightReceiver
from zmqsync.schemes.base import DEFAULT_CONNECT_TIMEOUT, WeightSyncScheme
from zmqsync.schemes.options import numbered, receiver_options
from zmqsync.transport.ray import (
    DELIVER_METHOD,
    POLL_INTERVAL,
    RayHub,
    RaySpoke,
    WeightSyncActorMixin,
)
from zmqsync.vocabulary import Strategy

__all__ = ["RayWeightSyncScheme", "WeightSyncActorMixin"]

log = logging.getLogger("zmqsync.schemes.ray")

#: Longest one of the sender's calls waits, while the actor is joining, for the joining
#: thread to handle what it delivered, so that the answer rides back on this call's
#: result instead of the next poll's (it normally takes a millisecond).
HANDSHAKE_STEP_SECONDS: Final = 1.0


class _ActorReceiver:
    """Drives a :class:`WeightReceiver` inside a Ray actor from the sender's calls.

    Joining is the receiver's own ``connect()`` (hello, probe, snapshot), run on a short-
    lived thread because each of its steps needs one more call from the sender. After that
    every call processes what it delivered at once: apply, ack, heartbeat.
    """

    def __init__(self, receiver: WeightReceiver, spoke: RaySpoke, *, fixed_index: bool) -> None:
        self.receiver = receiver
        self.spoke = spoke
        self.fixed_index = fixed_index
        self.connected = threading.Event()
        self._lock = threading.Lock()
        self._joining: threading.Thread | None = None
        self.error: str | None = None
        #: Why joining failed when the sender's weights do not fit the model: what the
        #: actor's connect() raises, until a version that fits is applied. Meanwhile the
        #: receiver stays in the fleet (it was welcomed), handling what the calls bring,
        #: rather than joining again on every call only to refuse the same version.
        self.mismatch: SchemaMismatchError | None = None
        self._settled = threading.Condition()
        receiver.on_applied.append(self._on_applied)

    def on_delivery(self) -> None:
        if not self.connected.is_set() and self.mismatch is None:
            self._join()
            # The joining thread answers what was just delivered; wait for that answer so
            # it goes back with this call.
            self.spoke.wait_reply(HANDSHAKE_STEP_SECONDS)
            if not self.connected.is_set() and self.mismatch is None:
                return
        if not self.receiver.closed:
            self.receiver.poll()

    def _join(self) -> None:
        with self._lock:
            if self._joining is not None and self._joining.is_alive():
                return
            if not self.fixed_index and self.spoke.peer_index is not None:
                self.receiver.worker_idx = self.spoke.peer_index  # what the hub calls us
            self._joining = threading.Thread(
                target=self._connect,
                name=f"zmqsync-ray-join-{self.receiver.model_id}",
                daemon=True,
            )
            self._joining.start()

    def _connect(self) -> None:
        try:
            self.receiver.connect()
        except Exception as exc:  # the sender's next call retries (a mismatch: see .mismatch)
            if not self.receiver.closed:
                with self._settled:
                    self.error = f"{type(exc).__name__}: {exc}"
                    if isinstance(exc, SchemaMismatchError):
                        self.mismatch = exc
                    self._settled.notify_all()
                if self.mismatch is not None:
                    log.warning("joining the sender: %s; this actor keeps its weights", exc)
                else:
                    log.warning(
                        "joining the sender failed (retried on its next call): %s", self.error
                    )
            return
        with self._settled:
            self.error = None
            self.mismatch = None
            self.connected.set()
            self._settled.notify_all()

    def _on_applied(self, epoch: int, version: int) -> None:
        """A version fits after all (the sender sent another model): joined."""
        if self.mismatch is None:
            return  # joining as usual: connect() says when it is done
        with self._settled:
            self.mismatch = None
            self.error = None
            self.connected.set()
            self._settled.notify_all()

    def wait_joined(self, timeout: float) -> bool:
        """Wait until this actor has joined (True) or ``timeout`` passed (False).

        Raises :class:`SchemaMismatchError` as soon as a join found that the sender's
        weights do not fit the model: waiting longer would not make them fit.
        """
        with self._settled:
            self._settled.wait_for(
                lambda: self.connected.is_set() or self.mismatch is not None, timeout
            )
            if self.connected.is_set():
                return True
            mismatch = self.mismatch
        if mismatch is not None:
            raise SchemaMismatchError(str(mismatch), key=mismatch.key) from mismatch
        return False

    def stop(self, timeout: float = 5.0) -> None:
        joining = self._joining
        if joining is not None:
            joining.join(timeout)


class RayWeightSyncScheme(WeightSyncScheme):
    """Weight synchronization with Ray actors (``remote_collectors``).

    Args:
        strategy: ``"state_dict"`` (default, as torchrl's) or ``"tensordict"``.
        timeout: seconds ``send()`` waits for every targeted actor's ack.
        connect_timeout: seconds ``connect()`` waits by default: the sender for every
            actor to join, a (threaded) actor for itself to join.
        method: the actor method the sender calls (:class:`WeightSyncActorMixin`
            provides it).
        poll_interval: longest gap between the sender's polls of an idle actor, which
            carry the actor's heartbeats and let it join.
        shared_memory: actors on the learner's host read each version in place from
            shared-memory blocks the sender reuses, instead of a new object in Ray's
            store per version (each actor is asked first whether it can; the others get
            the object store).
        device_memory: a learner on a GPU writes each version into device memory lent to
            the actors whose model lives on that same GPU, which copy it device to device
            (CUDA IPC: nothing crosses to the host). Actors elsewhere, on another GPU or
            on the CPU get it through the host, as without it.
        **sender_options: passed to :class:`~zmqsync.WeightSender`.

    Example::

        @ray.remote
        class Collector(WeightSyncActorMixin):
            def __init__(self, scheme):
                self.policy = make_policy()
                scheme.init_on_worker("policy", model=self.policy)   # returns at once

        scheme = RayWeightSyncScheme()
        actors = [Collector.remote(scheme) for _ in range(4)]
        scheme.init_on_sender("policy", remote_collectors=actors, model=policy)
        scheme.connect()          # every actor joined, with the current weights
        scheme.send()             # every actor holds the new version

    Every actor must be an actor of its own process (Ray's default), and call
    ``init_on_worker`` once per model it receives.
    """

    _transport_alias = "ray"

    def __init__(
        self,
        strategy: Strategy = "state_dict",
        *,
        timeout: float = 10.0,
        method: str = DELIVER_METHOD,
        poll_interval: float = POLL_INTERVAL,
        shared_memory: bool = True,
        device_memory: bool = True,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        **sender_options: Any,
    ) -> None:
        super().__init__(
            strategy, timeout=timeout, connect_timeout=connect_timeout, **sender_options
        )
        self.method = method
        self.poll_interval = poll_interval
        self.shared_memory = shared_memory
        self.device_memory = device_memory
        self._actor_side: _ActorReceiver | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_actor_side"] = None
        return state

    # --- transports ------------------------------------------------------------------

    def create_transport(
        self,
        pipe_or_context: Any = None,
        *,
        role: str = "hub",
        worker_idx: int = 0,
        **options: Any,
    ) -> RayHub | RaySpoke:
        """A Ray transport end: by default the sender's end for ONE remote actor.

        ``create_transport(actor_handle)`` gives a hub serving that actor as worker
        ``worker_idx``. (The scheme itself serves all its actors from one hub, so that a
        version goes into the object store once for all of them.) ``role="spoke"`` gives
        an actor's end.
        """
        options.pop("endpoint", None)
        if role == "hub":
            if pipe_or_context is None:
                raise ValueError("create_transport() needs the remote actor's handle")
            return self._hub({worker_idx: pipe_or_context}, **options)
        if role == "spoke":
            return RaySpoke(self._model_id or "policy")
        raise ValueError(f"role must be 'hub' or 'spoke'; got {role!r}")

    def _hub(self, actors: Sequence[Any] | Mapping[int, Any], **options: Any) -> RayHub:
        return RayHub(
            actors,
            channel=self._model_id or "policy",
            method=self.method,
            poll_interval=self.poll_interval,
            **{
                "shared_memory": self.shared_memory,
                "device_memory": self.device_memory,
                **options,
            },
        )

    # --- sender side -----------------------------------------------------------------

    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the sender for the remote actors.

        Args:
            model_id: which model (``"policy"``); also the name the actors register it by.
            context: optional object providing ``remote_collectors`` and the model
                (``get_model(model_id)`` or an attribute named ``model_id``).
            **kwargs: instead of a context: ``remote_collectors=`` (actor handles, a list
                or ``{worker_idx: handle}``), ``source_model=`` (or ``model=``); and any
                :class:`~zmqsync.WeightSender` option.
        """
        actors = self._actors(context, kwargs)
        source = kwargs.pop("source_model", None)
        if source is not None:
            kwargs.setdefault("model", source)
        indices = sorted(actors) if isinstance(actors, Mapping) else list(range(len(actors)))
        if indices == list(range(len(indices))):
            kwargs.setdefault("num_workers", len(indices))
        super().init_on_sender(model_id, context, remote_collectors=actors, **kwargs)

    def _open_hub(self, context: Any, kwargs: dict[str, Any], *, first_index: int = 0) -> RayHub:
        return self._hub(numbered(self._actors(context, kwargs), first_index))

    def _actors(self, context: Any, kwargs: dict[str, Any]) -> Sequence[Any] | Mapping[int, Any]:
        """The actor handles, from ``remote_collectors=`` (popped) or the context's."""
        return self._given(kwargs, context, "remote_collectors", "the actors' handles")

    def add_remote_collector(self, actor: Any) -> int:
        """Serve one more actor (a late joiner) and return its worker index.

        It joins like the others, at the latest version, and ``send()`` waits for it from
        then on.
        """
        sender = self.get_sender()
        hub = sender.transport
        assert isinstance(hub, RayHub)
        index = int(hub.add_actor(actor, index=sender.free_worker_id()).split(b":")[1])
        if sender.num_workers is not None:
            sender.num_workers = max(sender.num_workers, index + 1)
        return index

    # --- actor side ------------------------------------------------------------------

    def init_on_receiver(
        self, *, model_id: str = "policy", context: Any = None, **kwargs: Any
    ) -> None:
        """Set up this actor's receiver; returns at once.

        The actor joins when the sender next calls it (on its own, within
        ``poll_interval``), and then holds the latest version.

        Args:
            model_id: which model.
            context: optional object providing the model (the actor itself, typically).
            **kwargs: ``model=``; ``worker_idx=`` (by default the index the sender
                gave this actor); ``apply_mode=`` and ``chunk_timeout=`` (see
                :class:`WeightReceiver`).
        """
        if self._receiver is not None:
            raise RuntimeError("init_on_receiver() was already called on this scheme")
        self._take_model(model_id, context, kwargs)
        worker_idx = kwargs.pop("worker_idx", getattr(context, "worker_idx", None))
        kwargs.pop("pipe", None)  # torchrl passes one; Ray has no use for it
        options = receiver_options(kwargs)
        if kwargs:
            raise TypeError(f"unexpected arguments for init_on_worker: {sorted(kwargs)}")
        spoke = RaySpoke(model_id)
        self._worker_idx = None if worker_idx is None else int(worker_idx)
        receiver = WeightReceiver(
            spoke, worker_idx=self._worker_idx or 0, **self._settings(model_id), **options
        )
        self._actor_side = _ActorReceiver(receiver, spoke, fixed_index=worker_idx is not None)
        spoke.on_delivery = self._actor_side.on_delivery
        self._receiver = receiver

    @property
    def worker_idx(self) -> int | None:
        """This actor's index (given, or assigned by the sender once it called)."""
        side = self._actor_side
        if side is not None and not side.fixed_index:
            return side.receiver.worker_idx if side.connected.is_set() else None
        return self._worker_idx

    def connect(self, *, worker_idx: int | None = None, timeout: float | None = None) -> None:
        """On the sender: wait until every actor has joined. In an actor: wait until it
        has joined (only a threaded actor, ``max_concurrency > 1``, can wait: a plain
        actor runs the sender's calls only between its methods, so it never needs to).

        In an actor, raises :class:`SchemaMismatchError` if the sender's latest version
        does not fit the model (the model keeps its weights)."""
        side = self._actor_side
        if side is None:
            super().connect(worker_idx=worker_idx, timeout=timeout)
            return
        timeout = self.connect_timeout if timeout is None else timeout
        if not side.wait_joined(timeout):
            raise SyncTimeout(
                f"this actor did not join the sender of {self._model_id!r} within {timeout:g}s"
                + (f" (last error: {side.error})" if side.error else "")
                + ": has the sender called init_on_sender with this actor among "
                "remote_collectors? A plain (non-threaded) actor cannot wait here: the "
                "sender's calls run only after this method returns"
            )

    def shutdown(self) -> None:
        """Close the sender or this actor's receiver. Safe to call twice."""
        side, self._actor_side = self._actor_side, None
        super().shutdown()
        if side is not None:
            side.stop()
