"""What zmqsync's torchrl schemes share: torchrl's calling conventions around a zmqsync
scheme, on the learner and in each worker."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.weight_update import WeightSyncScheme as _TorchRLWeightSyncScheme

from zmqsync.receiver import APPLY_MODES, WeightReceiver
from zmqsync.schemes.base import WeightSyncScheme as _ZmqsyncScheme
from zmqsync.sender import WeightSender
from zmqsync.torchrl._model import (
    _built,
    _check_retain_snapshot,
    _ForwardLock,
    _materialize,
    _model_of,
    _PolicyVersion,
    _weightless,
)
from zmqsync.torchrl._plan import _FORMS, _count_workers, _Fanout, _is_per_worker, _nth, _Plan
from zmqsync.vocabulary import Strategy, WorkerIds


class _CollectorScheme(_TorchRLWeightSyncScheme):
    """What the torchrl classes share: torchrl's calling conventions and bookkeeping
    around a zmqsync scheme (``self._inner``), which does the syncing. Subclasses say how
    the inner scheme's sender and receiver are set up (:meth:`_hub_args`,
    :meth:`_start_receiver`).

    How a multiprocess collector drives it:

    - learner, ``init_on_sender(model_id=, context=collector, ctx=)``, before any worker
      starts: the inner scheme binds (ZMQ) or makes a ``ctx.Pipe()`` per worker (pipes),
      and publishes the policy's weights as version 0, waiting for no worker.
    - the scheme is pickled into each spawned worker: its settings, the endpoint, a pipe
      worker's end of its pipe; never sockets, threads, the model or a CURVE secret key.
    - worker, ``init_on_receiver(model=policy, worker_idx=i)`` then ``connect()``: a
      ``meta`` policy gets real storage, ``connect()`` returns holding version 0 (or
      newer), and a background thread applies every later version.
    - learner, ``connect()``: the pipe scheme closes its copies of the workers' ends, so
      a worker that dies is seen at once (end of file).
    - learner, ``update_policy_weights_(worker_ids=...)`` -> :meth:`send`: returns once
      every targeted worker applied the version, or raises :class:`zmqsync.SyncTimeout`
      naming those that did not.

    Unlike torchrl's own schemes, a worker holds a copy of its own, changed only by a
    send, and its forward passes hold the receiver's lock: none runs on half a version.
    """

    def __init__(
        self,
        inner_class: type[_ZmqsyncScheme],
        strategy: Strategy,
        options: dict[str, Any],
        *,
        sync: bool = True,
        per_worker_weights: bool = False,
    ) -> None:
        """Wrap ``inner_class(strategy, **options)``, the zmqsync scheme that syncs.

        ``options["apply_mode"]`` is the workers' (:class:`zmqsync.WeightReceiver`'s): torchrl
        builds each worker's receiver without asking, so the learner chooses it here
        and it travels to the workers inside the pickled scheme. So does
        ``options["lend_tensors"]``, which is both sides' (the sender's and every
        worker's)."""
        _check_retain_snapshot(options)
        options = dict(options)
        #: How each worker applies versions (``"shared"``: read-only views of the
        #: learner's shared memory); None leaves the receiver's default.
        self._apply_mode: str | None = _apply_mode(options.pop("apply_mode", None))
        #: Whether every worker lends its tensors to the learner, which writes each
        #: version into them (the sender's option of the same name, kept for the
        #: workers); None leaves the receiver's default.
        lend = options.get("lend_tensors")
        self._lend_tensors: bool | None = None if lend is None else bool(lend)
        inner = inner_class(strategy, **options)
        with warnings.catch_warnings():
            # torchrl warns that ITS state_dict application is experimental; zmqsync
            # applies weights itself (checked, all-or-nothing), so it does not apply here.
            warnings.filterwarnings("ignore", "state_dict strategy is experimental", UserWarning)
            super().__init__(strategy)
        self._inner = inner
        #: Per-worker weights, on the learner: one scheme per worker (see :class:`_Fanout`).
        self._fanout: _Fanout | None = None
        #: send() waits for the workers' acks (torchrl's ``sync``).
        self.sync = bool(sync)
        self._unsynced = False
        #: Each worker has weights of its own (one zmqsync sender per worker).
        self.per_worker_weights = bool(per_worker_weights)
        #: The policy has no weights (a RandomPolicy, a module without parameters):
        #: nothing to synchronize, so every call is a no-op. Pickled into the workers.
        self._weightless = False
        self._forward_lock: _ForwardLock | None = None
        self._local_model: Any = None
        self._policy_version = _PolicyVersion()

    # --- pickling into spawned workers -----------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # copy.copy goes through the inner scheme's __getstate__: no sockets, threads,
        # model or secret key travel (torchrl also "re-pickles" a scheme in place).
        state["_inner"] = copy.copy(self._inner)
        state["_fanout"] = copy.copy(self._fanout)
        state["_forward_lock"] = None
        state["_local_model"] = None
        state["_policy_version"] = _PolicyVersion()
        state["_unsynced"] = False
        return state

    # --- what the inner scheme knows -------------------------------------------------

    @property
    def endpoint(self) -> str | None:
        """Where workers reach the learner (set by ``init_on_sender``)."""
        return self._inner.endpoint

    @property
    def timeout(self) -> float:
        """Seconds ``send()`` waits for acks."""
        return self._inner.timeout

    @property
    def connect_timeout(self) -> float:
        """Seconds ``connect()`` waits, on the learner and in a worker (the inner
        scheme's: one setting, pickled into the workers with it)."""
        return self._inner.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, value: float) -> None:
        self._inner.connect_timeout = float(value)
        if self._fanout is not None:
            self._fanout.connect_timeout = float(value)

    @property
    def zmqsync_scheme(self) -> _ZmqsyncScheme:
        """The zmqsync scheme this one delegates to."""
        return self._inner

    def get_sender(self) -> WeightSender:
        """The zmqsync sender. ``RuntimeError`` before ``init_on_sender``, and with
        per-worker weights (each worker has its own: see :meth:`get_senders`)."""
        if self._fanout is not None:
            raise RuntimeError(
                f"{type(self).__name__} has per-worker weights: one sender per worker "
                "(get_senders())"
            )
        return self._inner.get_sender()

    def get_senders(self) -> dict[int | None, WeightSender]:
        """The zmqsync senders by worker with per-worker weights, else ``{None: sender}``."""
        return self._senders()

    def get_receiver(self) -> WeightReceiver:
        """The zmqsync receiver. ``RuntimeError`` before ``init_on_receiver``."""
        return self._inner.get_receiver()

    def status(self) -> dict[str, Any]:
        """The sender's sync state (see :meth:`zmqsync.WeightSender.status`)."""
        if self._weightless:
            return {"model_id": self._model_id, "version": 0, "workers": [], "weightless": True}
        return self._sending().status()

    def worker_versions(self) -> dict[int, int]:
        """Worker id -> the newest version it acked (see
        :meth:`zmqsync.WeightSender.worker_versions`); empty for a weightless policy."""
        return {} if self._weightless else self._sending().worker_versions()

    @property
    def lock(self) -> Any:
        """The receiver's lock: no version is applied while it is held."""
        return self._inner.lock

    def create_transport(self, *args: Any, **kwargs: Any) -> Any:
        """A transport end of the inner scheme (see its ``create_transport``)."""
        return self._inner.create_transport(*args, **kwargs)

    # --- the model -------------------------------------------------------------------

    @property
    def model(self) -> Any | None:
        """The model this side synchronizes."""
        if self._local_model is not None:
            return self._local_model
        if self._model_id is not None and self.context is not None:
            return _model_of(self.context, self._model_id)
        return None

    @model.setter
    def model(self, model: Any) -> None:
        # torchrl's worker calls this after building its collector, which may have
        # copied the policy (to a device, or wrapped): point the receiver at the copy.
        self._local_model = model
        if self.initialized_on_receiver:
            receiver = _built(self._inner.get_receiver)
            if receiver is not None:
                with receiver.lock:
                    receiver.model = model
                    if self._forward_lock is not None:
                        self._forward_lock.attach(model)
        elif self.initialized_on_sender:
            for sender in (_built(self._senders) or {}).values():
                sender.model = model

    # --- sender side -----------------------------------------------------------------

    def _init_on_sender_impl(
        self,
        *,
        model_id: str | None = "policy",
        context: Any = None,
        ctx: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start serving the workers and publish the learner's weights as version 0.

        Takes every keyword form torchrl's schemes take (``model``, ``weights``,
        ``params_map``, ``devices``, ``device_map_fn``, ``num_workers``: see
        :class:`_Plan`); ``ctx`` is torchrl's multiprocessing context (the pipe scheme
        makes its pipes with it), and what is left goes to :meth:`_hub_args`. Without
        weights (a collector built from a ``policy_factory`` only), nothing is
        published: each worker keeps the weights its factory made until the first
        explicit ``update_policy_weights_(weights)``.
        """
        forms = {name: kwargs.pop(name, None) for name in _FORMS}
        plan = _Plan.resolve(
            type(self).__name__,
            model_id=model_id,
            context=context,
            per_worker=self.per_worker_weights,
            **forms,
        )
        self._model_id = plan.model_id
        self.context = context
        self._local_model = plan.model
        if plan.weightless:
            self._weightless = True  # nothing to send, ever: no sockets, pipes or threads
            return
        args = self._hub_args(num_workers=plan.num_workers, context=context, ctx=ctx, **kwargs)
        if plan.per_worker is not None:
            try:
                workers = _count_workers(type(self).__name__, plan, args)
            except BaseException:
                self._releaser(args)()  # the pipes made for the workers
                raise
            self.per_worker_weights = True
            self._fanout = _Fanout(self._inner, range(workers))
        release = self._releaser(args)
        try:
            # What a send without weights reads: the model, else the weights given here
            # (torchrl's meaning: a params_map or weights= object, which the caller may
            # change in place). A sender with one publishes it at once: joining workers
            # take what is published (Clone pattern), and no worker is waited for.
            if self._fanout is not None:
                for i, sub in self._fanout.subs.items():
                    one = {key: {i: _nth(value, i)} for key, value in args.items()}
                    own = (plan.per_worker or {}).get(i)
                    source = plan.model if plan.model is not None else own
                    sub.init_on_sender(plan.model_id, model=source, num_workers=None, **one)
                    if own is not None and own is not source:
                        sub.get_sender().publish(own)  # device_map_fn's, for this worker
            else:
                counted = {} if plan.num_workers is None else {"num_workers": plan.num_workers}
                source = plan.model if plan.model is not None else plan.weights
                self._inner.init_on_sender(plan.model_id, model=source, **counted, **args)
        except BaseException:
            release()
            raise
        if context is not None:
            # torchrl's multiprocess collectors never shut their schemes down: close the
            # sockets, pipes and threads at the latest when the collector is collected.
            weakref.finalize(context, release)

    def _senders(self) -> dict[int | None, WeightSender]:
        """The zmqsync senders: one per worker with per-worker weights, else one (None)."""
        if self._fanout is not None:
            return {i: sub.get_sender() for i, sub in self._fanout.subs.items()}
        return {None: self._inner.get_sender()}

    def _sending(self) -> _ZmqsyncScheme | _Fanout:
        """What sends: the inner scheme, or with per-worker weights the fan-out."""
        return self._fanout if self._fanout is not None else self._inner

    def _hub_args(
        self, *, num_workers: int | None, context: Any, ctx: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """What the inner scheme's ``init_on_sender`` needs to reach the workers, each
        value a list or ``{worker: item}`` (a per-worker fan-out takes item ``i`` for
        worker ``i``). ``kwargs``: what torchrl passed beyond the common arguments (a
        Ray collector's ``remote_collectors``)."""
        raise NotImplementedError

    def _releaser(self, args: Mapping[str, Any]) -> Callable[[], None]:
        """What closes this side's resources; it must not refer to ``self`` (it runs
        from a finalizer)."""
        return self._sending().shutdown

    @staticmethod
    def _no_more(kwargs: Mapping[str, Any], method: str, owner: str) -> None:
        if kwargs:
            raise TypeError(f"{owner}.{method} got unexpected arguments {sorted(kwargs)}")

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any | None = None
    ) -> None:
        """Nothing to wait for: each worker fetches the latest version as it joins.

        With ``weights``, they are sent to every worker (waiting for them to join).
        """
        if weights is not None and not self._weightless:
            self._sending().connect(timeout=self.connect_timeout)
            self.send(weights)

    def send(self, weights: Any = None, worker_ids: WorkerIds = None) -> None:
        """Send weights; returns once every targeted worker applied them.

        ``weights``: ``None`` (the collector's policy), an ``nn.Module``, a
        ``TensorDict``, a ``dict`` of tensors, the name of a model in the context, or
        (per-worker weights) ``{worker_idx: weights}``, each worker getting its own.
        Raises :class:`zmqsync.SyncTimeout` naming workers that did not ack in time.
        A weightless policy has nothing to send: a no-op. With ``sync=False`` it returns
        once the version is on its way; the next send (or :meth:`wait_async`) waits for
        it first, and raises its errors.
        """
        if self._weightless:
            return
        if weights is None and all(s.model is None for s in self._senders().values()):
            raise ValueError(
                f"{type(self).__name__}: no weights to send: the learner holds no "
                f"{self._model_id!r} (a collector built from a policy_factory only). Pass "
                "them: update_policy_weights_(weights)"
            )
        if _is_per_worker(weights) and self._fanout is None:
            raise ValueError(
                f"{type(self).__name__} got weights by worker ({sorted(weights)}) but was not "
                "built for per-worker weights: pass per_worker_weights=True (or distinct "
                "policy factories, or a params_map with distinct weights)"
            )
        if isinstance(weights, str):
            if self.context is None:
                raise ValueError(
                    f"cannot resolve model name {weights!r}: this scheme has no context"
                )
            weights = _model_of(self.context, weights)
        if worker_ids is not None:
            # torchrl also lets collectors name workers by device; zmqsync workers are ids.
            ids = list(worker_ids) if isinstance(worker_ids, list | tuple) else [worker_ids]
            if any(isinstance(w, torch.device | str) for w in ids):
                raise TypeError(
                    f"{type(self).__name__} targets workers by index, not device: {worker_ids!r}"
                )
        if self.sync:
            self._sending().send(weights, worker_ids)
            return
        self._finish_unsynced()
        self._sending().send_async(weights, worker_ids)
        self._unsynced = True

    def _finish_unsynced(self) -> None:
        """Wait for the version a ``sync=False`` send left on its way."""
        if self._unsynced:
            self._unsynced = False
            self._sending().wait_async()

    def send_async(self, weights: Any = None, worker_ids: WorkerIds = None) -> None:
        """Start a send; :meth:`wait_async` completes it."""
        if not self._weightless:
            self._finish_unsynced()
            self._sending().send_async(weights, worker_ids)

    def wait_async(self) -> None:
        """Wait for the pending :meth:`send_async` (or ``sync=False`` send)."""
        if not self._weightless:
            self._unsynced = False
            self._sending().wait_async()

    # --- receiver side ---------------------------------------------------------------

    def _init_on_receiver_impl(
        self,
        model_id: str = "policy",
        context: Any = None,
        *,
        model: Any = None,
        worker_idx: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Build the worker's receiver; a ``meta`` policy gets real storage first."""
        self._no_more(kwargs, "init_on_receiver", type(self).__name__)
        self._model_id = model_id
        self.context = context
        if model is None and context is not None:
            model = _model_of(context, model_id)
        if worker_idx is None:
            worker_idx = getattr(context, "worker_idx", None)
        self._worker_idx = worker_idx
        if self._fanout is not None:
            # Per-worker weights: this worker joins its own sender only.
            self._inner, self._fanout = self._fanout.for_worker(worker_idx), None
        if self._weightless or _weightless(model):
            self._weightless = True  # the learner sends nothing: nothing to join
            self._local_model = model
            return
        model = _materialize(model)
        self._local_model = model
        self._start_receiver(model_id, model=model, worker_idx=worker_idx)
        receiver = self._inner.get_receiver()
        # Hooked now, not at connect(): a Ray actor may take its first version (on a
        # thread of its own) before torchrl ever calls connect().
        self._forward_lock = _ForwardLock(receiver.lock)
        self._forward_lock.attach(receiver.model)
        with receiver.lock:
            receiver.on_applied.append(self._record_version)
            receiver.on_applied.append(self._cascade)
            self._record_version(receiver.epoch, receiver.version)

    @property
    def context(self) -> Any | None:
        """The collector (or other object) this side works for, if still alive."""
        return _TorchRLWeightSyncScheme.context.fget(self)

    @context.setter
    def context(self, context: Any) -> None:
        _TorchRLWeightSyncScheme.context.fset(self, context)
        # A multiprocess worker connects (and applies its first version, maybe a late
        # joiner's newer one) before torchrl has built its collector, and hands the
        # collector over afterwards: tell it what its policy already holds.
        receiver = _built(self._inner.get_receiver) if hasattr(self, "_inner") else None
        if receiver is not None:
            with receiver.lock:
                self._record_version(receiver.epoch, receiver.version)

    def _record_version(self, epoch: int, version: int) -> None:
        """Tell the collector's policy-version tracker the version its policy holds."""
        self._policy_version.record(self.context, epoch, version)

    def _cascade(self, epoch: int, version: int) -> None:
        """Hand a version on to the collector's own workers, when this worker is itself a
        multi-process collector (a ``RayCollector`` remote collector that is a
        ``MultiSyncCollector``, say): as torchrl's schemes do, through the collector's
        ``update_policy_weights_``. Runs before this worker acks, so the learner's
        update returns once the collector's workers hold the version too.

        Such a collector may hold no policy of its own (built from a factory): the
        version is then kept by the receiver (its ``weights``) and handed on from there.
        """
        context = self.context
        if context is None or not getattr(context, "_weight_sync_schemes", None):
            return  # a leaf collector: its policy is the model just written
        receiver = self._inner.get_receiver()
        weights = receiver.model if receiver.model is not None else receiver.weights
        if weights is None:
            return
        if isinstance(weights, Mapping) and not isinstance(weights, TensorDictBase):
            weights = TensorDict(dict(weights)).unflatten_keys(".")  # state_dict keys
        context.update_policy_weights_(policy_or_weights=weights, model_id=self._model_id)

    def _start_receiver(self, model_id: str, *, model: Any, worker_idx: int | None) -> None:
        """Initialise the inner scheme's receiver."""
        self._inner.init_on_receiver(
            model_id=model_id, model=model, worker_idx=worker_idx, **self._receiver_options()
        )

    def _receiver_options(self) -> dict[str, Any]:
        """What the learner chose for every worker's receiver (``apply_mode``,
        ``lend_tensors``)."""
        options: dict[str, Any] = {}
        if self._apply_mode is not None:
            options["apply_mode"] = self._apply_mode
        if self._lend_tensors is not None:
            options["lend_tensors"] = self._lend_tensors
        return options

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        """Join the learner, return with real weights applied, then receive in the background."""
        if self._weightless:
            return
        receiver = self._inner.get_receiver()
        # The rendez-vous: returns holding what the learner published (its weights at
        # init_on_sender, or a newer version), or, if it published nothing (a collector
        # built from a policy_factory only), this worker's own until the first update.
        self._inner.connect(worker_idx=worker_idx, timeout=self.connect_timeout)
        self._worker_idx = receiver.worker_idx
        self._inner.start_receiver_thread()

    def receive(self, timeout: float | None = None) -> Any:
        """Apply a new version if one came (``None`` if none did).

        Once connected, the background thread applies versions as they arrive, so this
        returns ``None`` at once: the model already holds the newest version received.
        """
        if not self.initialized_on_receiver:
            raise RuntimeError(f"{type(self).__name__}: receive() needs init_on_receiver() first")
        if self._weightless:
            return None
        receiver = self._inner.get_receiver()
        if self.synchronized_on_receiver:
            return None  # the background thread receives for us
        return receiver.receive(timeout)

    # --- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the sockets or pipes, stop the background receiver, remove the hooks.
        Idempotent."""
        forward_lock, self._forward_lock = getattr(self, "_forward_lock", None), None
        if forward_lock is not None:
            forward_lock.detach()
        for part in (getattr(self, "_fanout", None), getattr(self, "_inner", None)):
            if part is not None:
                part.shutdown()
        super().shutdown()

    def __repr__(self) -> str:
        return f"zmqsync.torchrl.{self._inner!r}"


def _apply_mode(mode: Any) -> str | None:
    """``mode`` checked where the scheme is built, not later in each worker."""
    if mode is not None and mode not in APPLY_MODES:
        raise ValueError(f"apply_mode must be one of {APPLY_MODES}; got {mode!r}")
    return None if mode is None else str(mode)
