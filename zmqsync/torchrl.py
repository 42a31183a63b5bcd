"""zmqsync's schemes as torchrl ``WeightSyncScheme`` subclasses, for torchrl collectors.

torchrl's collectors accept any ``torchrl.weight_update.WeightSyncScheme`` in
``weight_sync_schemes=``; this module offers zmqsync's under the same names and
arguments:

- :class:`ZMQWeightSyncScheme`: ZeroMQ (fan-out or addressed), for
  ``MultiSyncCollector`` / ``MultiAsyncCollector`` (and workers on other hosts).
- :class:`MultiProcessWeightSyncScheme`: one duplex pipe per worker process, for
  ``MultiSyncCollector`` / ``MultiAsyncCollector``.
- :class:`RayWeightSyncScheme`: Ray calls and Ray's object store, for
  ``torchrl.collectors.distributed.RayCollector``.

::

    from torchrl.collectors import MultiSyncCollector
    import zmqsync.torchrl

    collector = MultiSyncCollector(
        [make_env] * 2, policy, frames_per_batch=64, total_frames=-1,
        weight_sync_schemes={"policy": zmqsync.torchrl.MultiProcessWeightSyncScheme()},
    )
    ...train policy...
    collector.update_policy_weights_()                # every worker holds it on return
    collector.update_policy_weights_(worker_ids=[0])  # exactly worker 0

How a multiprocess collector drives a scheme, and what each step does here:

- learner, ``init_on_sender(model_id=, context=collector, ctx=)``, before any worker
  starts: ZMQ binds its sockets; the pipe scheme makes one duplex ``ctx.Pipe()`` per
  worker and serves the learner's ends. Both publish the policy's current weights
  as version 0 (kept as the late-joiner snapshot; no worker is waited for). A
  collector built from a ``policy_factory`` only has no weights to publish: its
  workers keep their own until the first explicit update (version 1).
- the scheme is pickled into each spawned worker: settings and the endpoint, and for
  the pipe scheme the workers' pipe ends (a connection pickles while a process is being
  spawned). No sockets, threads, model or CURVE secret key travel.
- worker, ``init_on_receiver(model=policy, worker_idx=i)`` then ``connect()``: torchrl
  ships the policy's structure on the ``meta`` device, so the policy is first given real
  (CPU) storage, then ``connect()`` returns with version 0 (or newer) copied into it,
  and a background thread applies every later version. A pipe worker keeps its own pipe
  end and closes its siblings' at once.
- learner, ``connect()`` (after every worker started): the pipe scheme closes its copies
  of the workers' ends, so a worker that dies is seen at once (end of file).
- learner, ``update_policy_weights_(worker_ids=...)`` -> ``send``: returns once every
  targeted worker applied the version, or raises :class:`zmqsync.SyncTimeout` naming
  those that did not (a killed worker, for one) after ``timeout`` seconds.

Unlike torchrl's own schemes, a worker never aliases the learner's memory: it holds its
own copy, changed only by a send. A forward pass of the worker's policy holds the
receiver's lock (forward hooks), so it never runs on half of a version.

:class:`RayWeightSyncScheme` under ``RayCollector``: ``init_on_sender(remote_collectors=)``
starts calling each remote collector actor; torchrl then ships the scheme to each actor
(``register_scheme_receiver``), where ``init_on_receiver`` registers a receiver and
returns at once. The learner's calls reach it through Ray's built-in ``__ray_call__``,
which every Ray actor has, so torchrl's collector classes need no method of zmqsync's
(a method added inside the actor later would be unknown to the learner's handle, and
``cascade_execute("_receiver_schemes[...]...")`` fails until torchrl has registered the
scheme there): each call hands its frames to the receiver registered in that process
(none yet: the call returns nothing), which applies a version and acks on the same
call. The actor joins (hello, snapshot) through those calls, and torchrl's lazy
``connect()`` on the learner returns once every actor holds the latest version.

Each class delegates to the zmqsync scheme of the same name (composition): the torchrl
class only adapts torchrl's calling conventions and bookkeeping.

Importing this module registers the classes with torchrl's backend registry (see
:data:`BACKENDS`): ``WeightSyncScheme.from_backend("zmq")`` builds
:class:`ZMQWeightSyncScheme`.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Final, Literal

try:
    from torchrl.weight_update import WeightSyncScheme as _TorchRLWeightSyncScheme
    from torchrl.weight_update import weight_sync_schemes as _torchrl_registry
    from torchrl.weight_update.utils import _resolve_model
except ImportError as exc:  # pragma: no cover - exercised only without torchrl
    raise ImportError(
        "zmqsync.torchrl needs torchrl, which is not installed (or failed to import: "
        f"{exc}). Install it with `pip install 'zmqsync[torchrl]'` (or `pip install torchrl`), "
        "or use zmqsync's schemes directly without torchrl's collectors."
    ) from exc

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from zmqsync.errors import SyncTimeout
from zmqsync.receiver import WeightReceiver
from zmqsync.schemes.base import DEFAULT_CONNECT_TIMEOUT
from zmqsync.schemes.base import WeightSyncScheme as _ZmqsyncScheme
from zmqsync.schemes.multiprocess import MultiProcessWeightSyncScheme as _PipeScheme
from zmqsync.schemes.ray import RayWeightSyncScheme as _RayScheme
from zmqsync.schemes.zmq import ZMQWeightSyncScheme as _ZMQScheme
from zmqsync.security import CurveClient, CurveServer
from zmqsync.sender import WeightSender
from zmqsync.transport.ray import DELIVER_METHOD, POLL_INTERVAL, deliver

__all__ = [
    "BACKENDS",
    "MultiProcessWeightSyncScheme",
    "RayWeightSyncScheme",
    "ZMQWeightSyncScheme",
]

#: How often the Ray learner's ``connect()`` looks at where its actors stand.
_STATUS_POLL: Final = 0.01


def _materialize(model: Any) -> Any:
    """Give a ``meta``-device module real, uninitialised CPU storage, in place.

    torchrl sends workers the policy's structure only (parameters on ``meta``); the
    scheme's first version then fills the storage. A module with no meta tensors is
    returned untouched.
    """
    if not isinstance(model, nn.Module):
        return model  # a TensorDict or dict is the caller's own storage: never on meta here
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        # to_empty swaps the module's parameters for new CPU ones (same module objects).
        model.to_empty(device="cpu", recurse=True)
    return model


class _ForwardLock:
    """Forward hooks that hold a receiver's lock for a module's whole forward pass.

    ``always_call=True`` releases the lock even when the forward raises, so a failing
    policy cannot stall the background receiver. The hooks are plain closures, not bound
    methods: ``copy.deepcopy`` shares functions, so a hooked policy can still be deep
    copied (torchrl copies policies to their device), and the copy takes the same lock.
    """

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self._handles: list[Any] = []

        def acquire(module: nn.Module, args: Any) -> None:
            lock.acquire()

        def release(module: nn.Module, args: Any, output: Any) -> None:
            lock.release()

        acquire.zmqsync_lock = lock  # type: ignore[attr-defined]
        self._acquire, self._release = acquire, release

    def attach(self, module: Any) -> None:
        """Hook ``module`` (detaching from the previous one); non-modules are skipped."""
        self.detach()
        if not isinstance(module, nn.Module):
            return
        # A deep copy of a hooked module already carries these hooks: hooking it again
        # would take the lock twice per call.
        if any(
            getattr(h, "zmqsync_lock", None) is self.lock
            for h in module._forward_pre_hooks.values()
        ):
            return
        self._handles = [
            module.register_forward_pre_hook(self._acquire),
            module.register_forward_hook(self._release, always_call=True),
        ]

    def detach(self) -> None:
        """Remove the hooks this object added."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _check_retain_snapshot(sender_options: Mapping[str, Any]) -> None:
    if sender_options.get("retain_snapshot", True) is False:
        raise ValueError(
            "retain_snapshot=False cannot work with torchrl collectors: their workers "
            "take their first weights from the sender's snapshot. Leave it at True."
        )


class _CollectorScheme(_TorchRLWeightSyncScheme):
    """What the torchrl classes share: torchrl's calling conventions around a zmqsync
    scheme (``self._inner``). Subclasses say how the inner scheme's sender and receiver
    are set up (:meth:`_start_sender`, :meth:`_start_receiver`)."""

    def __init__(
        self,
        strategy: str,
        inner: _ZmqsyncScheme,
        *,
        sync: bool = True,
        per_worker_weights: bool = False,
    ) -> None:
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
        #: What the collector's policy-version tracker was last told: (tracker id,
        #: epoch, version), so a uuid tracker gets one new id per version, not per call.
        self._recorded: tuple[int, int, int] | None = None

    # --- pickling into spawned workers -----------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # copy.copy goes through the inner scheme's __getstate__: no sockets, threads,
        # model or secret key travel (torchrl also "re-pickles" a scheme in place).
        state["_inner"] = copy.copy(self._inner)
        state["_fanout"] = copy.copy(self._fanout)
        state["_forward_lock"] = None
        state["_local_model"] = None
        state["_recorded"] = None
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
        model: Any = None,
        weights: Any = None,
        params_map: Mapping[int, Any] | None = None,
        devices: Sequence[Any] | None = None,
        device_map_fn: Callable[[int, Any], Any] | None = None,
        num_workers: int | None = None,
        ctx: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start serving the workers and publish the learner's weights as version 0.

        Takes every keyword form torchrl's schemes take (see :class:`_Plan`); ``ctx`` is
        torchrl's multiprocessing context (the pipe scheme makes its pipes with it).
        Without weights (a collector built from a ``policy_factory`` only), nothing is
        published: each worker keeps the weights its factory made until the first
        explicit ``update_policy_weights_(weights)``.
        """
        plan = _Plan.resolve(
            type(self).__name__,
            model_id=model_id,
            context=context,
            model=model,
            weights=weights,
            params_map=params_map,
            devices=devices,
            device_map_fn=device_map_fn,
            num_workers=num_workers,
            per_worker=self.per_worker_weights,
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

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
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

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
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
        """Set the collector's policy-version tracker (``track_policy_version=True``)
        to the version the policy now holds: what torchrl writes under
        ``"policy_version"`` in each frame and saves in ``state_dict()``.

        torchrl's own schemes bump the tracker from their ``receive()``; zmqsync applies
        versions in its own thread (or at connect), so it is told here, from the
        receiver's ``on_applied`` listeners: under the receiver's lock, which every
        forward pass holds too, so no forward runs on a version the tracker does not
        name yet. (torchrl writes the tag at the env step that follows the forward, after
        the lock is let go: a version landing in that gap tags that one frame with the
        newer version, as with torchrl's own schemes.)
        """
        tracker = getattr(self.context, "policy_version_tracker", None)
        if tracker is None:
            return
        recorded = (id(tracker), epoch, version)
        previous, self._recorded = self._recorded, recorded
        if recorded == previous:
            return
        if getattr(tracker, "version_type", int) in (int, "int"):
            # torchrl counts updates: the initial weights are 0, two updates make 2, as
            # the learner numbers its versions (it publishes its initial weights as 0).
            # Numbering by the learner's version, not by updates this worker got, keeps
            # equal numbers meaning equal weights across workers (a worker skipped by
            # worker_ids= jumps ahead); a restarted learner numbers from 0 again.
            tracker.version = version
        elif version > 0 or (previous is not None and previous[1] != epoch):
            tracker.increment_version()  # a uuid tracker: a fresh id per new version

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
        self._inner.init_on_receiver(model_id=model_id, model=model, worker_idx=worker_idx)

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


class ZMQWeightSyncScheme(_CollectorScheme):
    """:class:`zmqsync.ZMQWeightSyncScheme` as a torchrl ``WeightSyncScheme``.

    Same arguments as :class:`zmqsync.ZMQWeightSyncScheme`.

    Args:
        strategy: ``"tensordict"`` (default) or ``"state_dict"``.
        mode: ``"pubsub"`` (fan-out) or ``"router"`` (addressed).
        endpoint: where the learner binds; ``None`` picks a free ipc path.
        timeout: seconds ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted worker's ack before raising :class:`zmqsync.SyncTimeout`.
        curve_server / curve_client / insecure: ZeroMQ CURVE, as in zmqsync.
        connect_timeout: seconds a worker waits in ``connect()`` for the learner and
            its first version (and the learner, when it waits, for its workers).
        **sender_options: ``heartbeat``, ``repair_after``, ... (``retain_snapshot`` must
            stay ``True``: workers take their first weights from the snapshot).
    """

    _inner: _ZMQScheme

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "tensordict",
        *,
        mode: Literal["pubsub", "router"] = "pubsub",
        endpoint: str | None = None,
        timeout: float = 10.0,
        curve_server: CurveServer | None = None,
        curve_client: CurveClient | None = None,
        insecure: bool = False,
        shared_memory: bool | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        sync: bool = True,
        per_worker_weights: bool = False,
        **sender_options: Any,
    ) -> None:
        _check_retain_snapshot(sender_options)
        inner = _ZMQScheme(
            strategy,
            mode=mode,
            endpoint=endpoint,
            timeout=timeout,
            curve_server=curve_server,
            curve_client=curve_client,
            insecure=insecure,
            shared_memory=shared_memory,
            connect_timeout=connect_timeout,
            **sender_options,
        )
        if per_worker_weights and endpoint is not None:
            raise ValueError(
                "per_worker_weights=True serves each worker from an endpoint of its own: "
                f"leave endpoint=None (got {endpoint!r})"
            )
        super().__init__(strategy, inner, sync=sync, per_worker_weights=per_worker_weights)

    @property
    def mode(self) -> str:
        """``"pubsub"`` or ``"router"``."""
        return self._inner.mode

    def _hub_args(
        self, *, num_workers: int | None, context: Any, ctx: Any, **kwargs: Any
    ) -> dict[str, Any]:
        # ctx is unused: workers reach the learner over ZeroMQ, not torchrl's pipes.
        self._no_more(kwargs, "init_on_sender", type(self).__name__)
        return {}


class MultiProcessWeightSyncScheme(_CollectorScheme):
    """:class:`zmqsync.MultiProcessWeightSyncScheme` (one duplex pipe per worker) as a
    torchrl ``WeightSyncScheme``, for ``MultiSyncCollector`` / ``MultiAsyncCollector``.

    Same arguments as :class:`zmqsync.MultiProcessWeightSyncScheme`. The scheme makes
    the pipes itself (``init_on_sender``, with torchrl's multiprocessing context) and
    they travel to the workers inside the pickled scheme; nothing else is shared with
    torchrl's own pipes.

    Args:
        strategy: ``"state_dict"`` (default) or ``"tensordict"``.
        timeout: seconds ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted worker's ack before raising :class:`zmqsync.SyncTimeout`.
        connect_timeout: seconds a worker waits in ``connect()`` for the learner and
            its first version (and the learner, when it waits, for its workers).
        **sender_options: ``heartbeat``, ``repair_after``, ... (``retain_snapshot`` must
            stay ``True``: workers take their first weights from the snapshot).

    Without a collector: ``init_on_sender(model_id, model=..., num_workers=N)``, start
    the workers with the scheme (``spawn`` or ``forkserver``), call ``connect()`` on the
    learner once they all started, and in worker ``i``
    ``init_on_receiver(model_id=..., model=..., worker_idx=i)`` then ``connect()``.
    """

    _inner: _PipeScheme

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "state_dict",
        *,
        timeout: float = 10.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        sync: bool = True,
        per_worker_weights: bool = False,
        **sender_options: Any,
    ) -> None:
        _check_retain_snapshot(sender_options)
        inner = _PipeScheme(
            strategy, timeout=timeout, connect_timeout=connect_timeout, **sender_options
        )
        super().__init__(strategy, inner, sync=sync, per_worker_weights=per_worker_weights)
        #: The workers' ends of their pipes, by worker index: held by the learner only
        #: until the workers have started (``connect()``), carried into them by pickling.
        self._worker_ends: dict[int, Connection] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # Every worker gets every end (one pickled scheme serves them all) and closes
        # its siblings' at init_on_receiver. Pickling a connection hands a duplicate of
        # its descriptor to the process being spawned.
        state["_worker_ends"] = {i: c for i, c in self._worker_ends.items() if not c.closed}
        return state

    def _hub_args(
        self, *, num_workers: int | None, context: Any, ctx: Any, **kwargs: Any
    ) -> dict[str, Any]:
        self._no_more(kwargs, "init_on_sender", type(self).__name__)
        if num_workers is None:
            raise ValueError(
                "MultiProcessWeightSyncScheme.init_on_sender needs the number of workers: "
                "pass num_workers=N (or devices=[...]), or a context (collector) with a "
                "num_workers attribute"
            )
        if ctx is not None and ctx.get_start_method() == "fork":
            raise ValueError(
                "MultiProcessWeightSyncScheme needs workers started with 'spawn' (torchrl's "
                "default) or 'forkserver': a forked worker would inherit the learner's pipe "
                "ends and sender state. Drop mp.set_start_method('fork'), or use "
                "zmqsync.torchrl.ZMQWeightSyncScheme"
            )
        # Every multiprocessing context makes the same pipes; torchrl's is used for form.
        pairs = [(ctx or multiprocessing).Pipe(duplex=True) for _ in range(num_workers)]
        self._worker_ends = {i: child for i, (_, child) in enumerate(pairs)}
        return {"pipes": [parent for parent, _ in pairs]}

    def _releaser(self, args: Mapping[str, Any]) -> Callable[[], None]:
        inner, ends, parents = self._sending(), self._worker_ends, list(args.get("pipes", ()))

        def release() -> None:
            _close_all(ends)
            for parent in parents:  # closed by the hub once it owns them; again is a no-op
                parent.close()
            inner.shutdown()

        return release

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any | None = None
    ) -> None:
        """Close the learner's copies of the workers' pipe ends (every worker has been
        started by now): from here on, a worker that dies is seen at once."""
        _close_all(self._worker_ends)
        if self._weightless:
            return
        super()._setup_connection_and_weights_on_sender_impl(worker_idx=worker_idx, weights=weights)

    def _start_receiver(self, model_id: str, *, model: Any, worker_idx: int | None) -> None:
        ends, self._worker_ends = self._worker_ends, {}
        carried = sorted(ends)
        end = ends.pop(worker_idx, None) if worker_idx is not None else None
        # A sibling's end held here would hide that sibling's death from the learner.
        _close_all(ends)
        if end is None:
            raise RuntimeError(
                f"{type(self).__name__}: this scheme carries no pipe end for worker "
                f"{worker_idx!r} (it has ends for workers {carried}). Pass worker_idx=, "
                "and hand the scheme to each worker process when it starts: after the "
                "learner's init_on_sender() and before the learner's connect()"
            )
        self._inner.init_on_receiver(
            model_id=model_id, model=model, pipe=end, worker_idx=worker_idx
        )

    def shutdown(self) -> None:
        """Close the pipes, stop the background receiver, remove the hooks. Idempotent."""
        _close_all(getattr(self, "_worker_ends", {}))
        super().shutdown()


def _close_all(ends: dict[int, Connection]) -> None:
    """Close (and forget) pipe ends this process holds for others."""
    for conn in ends.values():
        conn.close()
    ends.clear()


def _deliver_in_actor(actor: Any, channel: str, peer_index: int, frames: Any) -> list[list[bytes]]:
    """Run by Ray inside a remote collector (``actor.__ray_call__``): hand one of the
    learner's calls to the receiver this process registered for ``channel``."""
    del actor  # the receiver is found by channel, not through the collector object
    return deliver(channel, peer_index, frames)


class _RayCall:
    """What :class:`~zmqsync.transport.ray.RayHub` calls ``.remote(channel, index,
    frames)`` on: one actor's built-in ``__ray_call__``, running
    :func:`_deliver_in_actor` there."""

    def __init__(self, handle: Any) -> None:
        self._call = handle.__ray_call__

    def remote(self, channel: str, peer_index: int, frames: Any) -> Any:
        # frames (maybe an ObjectRef into the object store) stays a top-level argument,
        # so Ray resolves it before the call runs, as for a method of the actor's own.
        return self._call.remote(_deliver_in_actor, channel, peer_index, frames)


def _through_ray_call(handle: Any) -> Any:
    """``handle`` as the hub sees it: its delivery method goes through ``__ray_call__``."""
    return types.SimpleNamespace(**{DELIVER_METHOD: _RayCall(handle), "handle": handle})


class RayWeightSyncScheme(_CollectorScheme):
    """:class:`zmqsync.RayWeightSyncScheme` as a torchrl ``WeightSyncScheme``, for
    ``torchrl.collectors.distributed.RayCollector``.

    Same arguments as :class:`zmqsync.RayWeightSyncScheme`.

    Args:
        strategy: ``"state_dict"`` (default) or ``"tensordict"``.
        timeout: seconds ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted actor's ack before raising :class:`zmqsync.SyncTimeout` (a
            killed actor, for one).
        method: ``None`` (default): reach each actor through Ray's built-in
            ``__ray_call__``, which torchrl's remote collectors (any Ray actor) have. A
            name: call that method of the actor instead (an actor class that inherits
            :class:`zmqsync.WeightSyncActorMixin` has ``"zmqsync_deliver"``).
        poll_interval: longest gap between the learner's polls of an idle actor.
        connect_timeout: seconds the learner's ``connect()`` (torchrl calls it before
            the first update) waits for every actor to hold the latest version.
        **sender_options: ``heartbeat``, ``repair_after``, ... (``retain_snapshot`` must
            stay ``True``).

    A remote collector applies versions between its own method calls (a plain Ray actor
    runs one call at a time), so an update sent while it collects a batch lands when
    that batch is done; ``timeout`` must cover one batch.
    """

    _inner: _RayScheme

    def __init__(
        self,
        strategy: Literal["state_dict", "tensordict"] = "state_dict",
        *,
        timeout: float = 10.0,
        method: str | None = None,
        poll_interval: float = POLL_INTERVAL,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        sync: bool = True,
        per_worker_weights: bool = False,
        **sender_options: Any,
    ) -> None:
        _check_retain_snapshot(sender_options)
        if "backend" in sender_options:
            raise TypeError(
                "zmqsync.torchrl.RayWeightSyncScheme does not take backend=: it moves weights "
                "through Ray's calls and object store (and shared memory on one host), not "
                "a torch.distributed process group. Drop the argument."
            )
        inner = _RayScheme(
            strategy,
            timeout=timeout,
            method=DELIVER_METHOD if method is None else method,
            poll_interval=poll_interval,
            connect_timeout=connect_timeout,
            **sender_options,
        )
        super().__init__(strategy, inner, sync=sync, per_worker_weights=per_worker_weights)
        self.method = method

    def _hub_args(
        self,
        *,
        num_workers: int | None,
        context: Any,
        ctx: Any,
        remote_collectors: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        self._no_more(kwargs, "init_on_sender", type(self).__name__)
        actors = (
            remote_collectors
            if remote_collectors is not None
            else getattr(context, "remote_collectors", None)
        )
        if actors is None:
            raise ValueError(
                "RayWeightSyncScheme.init_on_sender needs the remote collectors: pass "
                "remote_collectors=[handle, ...], or a context (RayCollector) that has them"
            )
        if self.method is None:
            if isinstance(actors, Mapping):
                actors = {i: _through_ray_call(h) for i, h in actors.items()}
            else:
                actors = [_through_ray_call(h) for h in actors]
        return {"remote_collectors": actors}

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any | None = None
    ) -> None:
        """Wait until every actor holds the latest version (RayCollector calls this
        before its first update: collection then starts from the learner's weights)."""
        if self._weightless:
            return
        self._wait_until_current(self.connect_timeout)
        super()._setup_connection_and_weights_on_sender_impl(worker_idx=worker_idx, weights=weights)

    def _wait_until_current(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            behind: dict[int, tuple[int, int, bool]] = {}
            for mine, sender in self._senders().items():
                expected = set(sender.worker_versions()) if mine is None else {mine}
                current = sender.current_workers()
                if expected <= current:
                    continue
                versions, joined = sender.worker_versions(), sender.connected_workers()
                for w in expected - current:
                    behind[w] = (versions.get(w, 0), sender.version, w in joined)
            if not behind:
                return
            if time.monotonic() >= deadline:
                details = "; ".join(
                    f"worker {w} holds version {v} of {latest}"
                    + ("" if joined else " (never joined)")
                    for w, (v, latest, joined) in sorted(behind.items())
                )
                raise SyncTimeout(
                    f"{len(behind)} Ray actor(s) did not reach the latest version of "
                    f"{self._model_id!r} within {timeout:g}s: {details}. Is each remote "
                    "collector alive, and did it get the scheme (register_scheme_receiver)?",
                    missing_workers=behind,
                )
            time.sleep(_STATUS_POLL)  # status is local bookkeeping: cheap to look at

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        """Nothing to wait for in the actor: it joins through the learner's calls, which a
        plain Ray actor runs only after this method returns (waiting here would hang)."""

    def receive(self, timeout: float | None = None) -> Any:
        """``None``: versions are applied as the learner's calls deliver them."""
        if not self.initialized_on_receiver:
            raise RuntimeError(f"{type(self).__name__}: receive() needs init_on_receiver() first")
        return None


#: The names ``torchrl.weight_update.WeightSyncScheme.from_backend`` knows zmqsync's
#: schemes by once this module is imported. torchrl has no ZeroMQ backend, so "zmq" is
#: zmqsync's; the pipe and Ray schemes take prefixed names, leaving torchrl's own
#: "process" and "ray" to torchrl's schemes.
BACKENDS: Final[Mapping[str, type[_CollectorScheme]]] = types.MappingProxyType(
    {
        "zmq": ZMQWeightSyncScheme,
        "zmqsync-zmq": ZMQWeightSyncScheme,
        "zmqsync-pipe": MultiProcessWeightSyncScheme,
        "zmqsync-ray": RayWeightSyncScheme,
    }
)


def _register_backends() -> None:
    taken = getattr(_torchrl_registry, "_WEIGHT_SYNC_SCHEMES", {})
    for name, cls in BACKENDS.items():
        if name in taken and not issubclass(taken[name], _CollectorScheme):
            # A torchrl with a backend of that name keeps it: "zmqsync-zmq" still works.
            continue
        _torchrl_registry.register_weight_sync_backend(name)(cls)


_register_backends()


def _model_of(context: Any, model_id: str) -> Any:
    """The model named ``model_id`` in a torchrl collector (or any object)."""
    getter = getattr(context, "get_model", None)
    if callable(getter):
        try:
            return getter(model_id)
        except (ValueError, AttributeError, KeyError):
            pass
    try:
        return _resolve_model(context, model_id)
    except AttributeError:
        return None


def _weightless(model: Any) -> bool:
    """Whether ``model`` holds no weights to synchronize: a module without parameters or
    buffers, an empty TensorDict or dict, or a policy that is not a module at all and
    has no ``state_dict`` (torchrl's ``RandomPolicy``)."""
    if model is None:
        return False
    if isinstance(model, nn.Module):
        return next(model.parameters(), None) is None and next(model.buffers(), None) is None
    if isinstance(model, TensorDictBase):
        return next(iter(model.keys(True, True)), None) is None
    if isinstance(model, Mapping):
        return not model
    return not callable(getattr(model, "state_dict", None))


def _built(getter: Any) -> Any:
    """``getter()`` (the inner scheme's get_sender/get_receiver), or None before init."""
    try:
        return getter()
    except RuntimeError:
        return None


def _is_per_worker(weights: Any) -> bool:
    """Whether ``weights`` is ``{worker_idx: weights}`` (torchrl's per-worker form)."""
    return (
        isinstance(weights, Mapping)
        and not isinstance(weights, TensorDictBase)
        and bool(weights)
        and all(isinstance(k, int) and not isinstance(k, bool) for k in weights)
    )


def _count_workers(owner: str, plan: _Plan, args: Mapping[str, Any]) -> int:
    """How many workers a per-worker fan-out serves."""
    workers = plan.num_workers
    if workers is None and args:
        workers = len(next(iter(args.values())))  # one pipe or actor per worker
    if workers is None:
        raise ValueError(
            f"{owner}: per-worker weights need the number of workers: pass num_workers=, "
            "devices=, params_map=, or a context (collector)"
        )
    if plan.per_worker and not set(plan.per_worker) <= set(range(workers)):
        raise ValueError(
            f"{owner}: weights given for workers {sorted(plan.per_worker)} but there are "
            f"workers 0..{workers - 1}"
        )
    return workers


def _nth(value: Any, i: int) -> Any:
    """Worker ``i``'s item of a list or ``{worker: item}``."""
    return value[i]


@dataclasses.dataclass
class _Plan:
    """What ``init_on_sender`` was asked for, in any of torchrl's keyword forms.

    - ``context=collector`` (with ``model_id``): the collector's policy; a collector
      built from ``policy_factory`` only has none (the weights come with the first
      explicit update), and with distinct factories each worker has its own weights.
    - ``model=`` or ``weights=``, with ``devices=[...]`` (one per worker), or
      ``device_map_fn=`` and ``num_workers=``: zmqsync places every tensor on the
      device of the worker's own model, so devices only count the workers.
    - ``params_map={worker: weights}``: the same object for every worker is one set
      of weights; distinct ones are per-worker weights.
    """

    model_id: str
    model: Any
    weights: Any
    num_workers: int | None
    per_worker: dict[int, Any] | None
    weightless: bool

    @classmethod
    def resolve(
        cls,
        owner: str,
        *,
        model_id: str | None,
        context: Any,
        model: Any,
        weights: Any,
        params_map: Mapping[int, Any] | None,
        devices: Sequence[Any] | None,
        device_map_fn: Callable[[int, Any], Any] | None,
        num_workers: int | None,
        per_worker: bool,
    ) -> _Plan:
        model_id = model_id or "policy"
        if params_map is not None:
            return cls._from_params_map(
                owner, model_id, params_map, num_workers, per_worker,
                others={"context": context, "model": model, "weights": weights,
                        "devices": devices, "device_map_fn": device_map_fn},
            )  # fmt: skip
        if model is not None and weights is not None:
            raise ValueError(f"{owner}.init_on_sender: pass model= or weights=, not both")
        if devices is not None:
            if num_workers is not None and num_workers != len(devices):
                raise ValueError(
                    f"{owner}.init_on_sender: num_workers={num_workers} but {len(devices)} "
                    "devices (one per worker)"
                )
            num_workers = len(devices)
        if device_map_fn is not None:
            if not callable(device_map_fn):
                raise TypeError(f"{owner}.init_on_sender: device_map_fn must be callable")
            if num_workers is None:
                raise ValueError(f"{owner}.init_on_sender: device_map_fn needs num_workers=")
        if num_workers is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        if model is None and context is not None:
            model = _model_of(context, model_id)
        if model is None and weights is None and context is not None and model_id == "policy":
            factories = getattr(context, "policy_factory", None)
            if isinstance(factories, Sequence) and len({id(f) for f in factories}) > 1:
                per_worker = True  # distinct factories: each worker's weights are its own
        if weights is None and _weightless(model):
            return cls(model_id, model, None, num_workers, None, weightless=True)
        if not per_worker:
            return cls(model_id, model, weights, num_workers, None, weightless=False)
        mine: dict[int, Any] = {}
        base = weights if weights is not None else model
        if base is not None and num_workers is not None:
            mine = {
                i: device_map_fn(i, base) if device_map_fn is not None else base
                for i in range(num_workers)
            }
        return cls(model_id, model, None, num_workers, mine, weightless=False)

    @classmethod
    def _from_params_map(
        cls,
        owner: str,
        model_id: str,
        params_map: Mapping[int, Any],
        num_workers: int | None,
        per_worker: bool,
        others: Mapping[str, Any],
    ) -> _Plan:
        given = sorted(name for name, value in others.items() if value is not None)
        if given:
            raise ValueError(
                f"{owner}.init_on_sender: params_map= says everything; it cannot be "
                f"combined with {', '.join(given)}"
            )
        if not _is_per_worker(params_map):
            raise ValueError(
                f"{owner}.init_on_sender: params_map must be a non-empty "
                "{worker_idx: weights} dict"
            )
        workers = sorted(params_map)
        if workers != list(range(len(workers))):
            raise ValueError(
                f"{owner}.init_on_sender: params_map must name workers 0..n-1; got {workers}"
            )
        if num_workers is not None and num_workers != len(workers):
            raise ValueError(
                f"{owner}.init_on_sender: num_workers={num_workers} but params_map has "
                f"{len(workers)} workers"
            )
        values = [params_map[i] for i in workers]
        if not per_worker and all(v is values[0] for v in values):
            return cls(model_id, None, values[0], len(workers), None, weightless=False)
        return cls(model_id, None, None, len(workers), dict(params_map), weightless=False)


class _Fanout:
    """Per-worker weights: one zmqsync scheme per worker (copies of ``template``), so
    each worker has versions, a snapshot (what it gets when it restarts) and acks of its
    own. A send of ``{worker: weights}`` goes to each named worker at once, a send of
    one set of weights to every worker (or those in ``worker_ids``)."""

    def __init__(self, template: _ZmqsyncScheme, workers: Iterable[int]) -> None:
        if getattr(template, "endpoint", None) is not None:
            raise ValueError(
                "per-worker weights serve each worker from an endpoint of its own: leave "
                f"endpoint=None (got {template.endpoint!r})"
            )
        self.template = template
        self.subs: dict[int, _ZmqsyncScheme] = {i: copy.copy(template) for i in workers}
        self._pending: list[_ZmqsyncScheme] = []

    def __copy__(self) -> _Fanout:
        # What pickles into the workers: each sub-scheme's settings and endpoint only.
        clone = _Fanout.__new__(_Fanout)
        clone.template = copy.copy(self.template)
        clone.subs = {i: copy.copy(sub) for i, sub in self.subs.items()}
        clone._pending = []
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return self.__copy__().__dict__

    # --- settings (the template's, kept the same in every sub-scheme) -----------------

    @property
    def endpoint(self) -> str | None:
        return None  # one per worker: see endpoints

    @property
    def endpoints(self) -> dict[int, str | None]:
        return {i: sub.endpoint for i, sub in self.subs.items()}

    @property
    def timeout(self) -> float:
        return self.template.timeout

    @property
    def connect_timeout(self) -> float:
        return self.template.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, value: float) -> None:
        for scheme in (self.template, *self.subs.values()):
            scheme.connect_timeout = value

    def create_transport(self, *args: Any, **kwargs: Any) -> Any:
        return self.template.create_transport(*args, **kwargs)

    def for_worker(self, worker_idx: int | None) -> _ZmqsyncScheme:
        """Worker ``worker_idx``'s own scheme (in that worker's process)."""
        if worker_idx not in self.subs:
            raise RuntimeError(
                f"per-worker weights are set up for workers {sorted(self.subs)}; this worker "
                f"is {worker_idx!r} (pass worker_idx=)"
            )
        return self.subs[worker_idx]

    # --- the learner -----------------------------------------------------------------

    def _sends(self, weights: Any, worker_ids: int | list[int] | None) -> dict[int, Any]:
        """Worker -> what it is sent."""
        if worker_ids is None:
            chosen = list(weights) if _is_per_worker(weights) else list(self.subs)
        else:
            chosen = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        unknown = sorted(w for w in chosen if w not in self.subs)
        if unknown:
            raise ValueError(f"no workers {unknown}: this scheme has workers {sorted(self.subs)}")
        if not _is_per_worker(weights):
            return dict.fromkeys(chosen, weights)
        missing = sorted(w for w in chosen if w not in weights)
        if missing:
            raise ValueError(f"no weights given for workers {missing}")
        return {w: weights[w] for w in chosen}

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        if self._pending:
            raise RuntimeError("a send_async() is pending: wait_async() first")
        for w, own in self._sends(weights, worker_ids).items():
            try:
                self.subs[w].send_async(own, [w])
            except BaseException:
                self.wait_async()  # what already started completes (or times out)
                raise
            self._pending.append(self.subs[w])

    def wait_async(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            raise RuntimeError("no send_async() is pending: nothing to wait for")
        missing: set[int] = set()
        failures: list[str] = []
        first: BaseException | None = None
        for sub in pending:
            try:
                sub.wait_async()
            except SyncTimeout as exc:
                missing.update(exc.missing_workers)
                failures.append(str(exc))
            except BaseException as exc:  # every sub is waited for before raising
                first = first or exc
        if first is not None:
            raise first
        if failures:
            raise SyncTimeout("; ".join(failures), missing_workers=missing)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        self.send_async(weights, worker_ids)
        self.wait_async()

    def connect(self, *, timeout: float) -> None:
        """Wait until every worker has joined its own sender."""
        deadline = time.monotonic() + timeout
        while True:
            missing = {
                i for i, sub in self.subs.items() if i not in sub.get_sender().connected_workers()
            }
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise SyncTimeout(
                    f"workers {sorted(missing)} did not connect within {timeout:g}s",
                    missing_workers=missing,
                )
            time.sleep(_STATUS_POLL)

    def worker_versions(self) -> dict[int, int]:
        return {i: sub.worker_versions().get(i, 0) for i, sub in self.subs.items()}

    def status(self) -> dict[str, Any]:
        per = {i: sub.status() for i, sub in self.subs.items()}
        rows = [row for i, st in per.items() for row in st["workers"] if row["worker"] == i]
        return {
            "model_id": self.template.model_id,
            "per_worker": True,
            "version": {i: st["version"] for i, st in per.items()},
            "workers": rows,
        }

    def shutdown(self) -> None:
        for sub in self.subs.values():
            sub.shutdown()
        self.template.shutdown()
