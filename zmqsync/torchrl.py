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
  as version 1 (kept as the late-joiner snapshot; no worker is waited for).
- the scheme is pickled into each spawned worker: settings and the endpoint, and for
  the pipe scheme the workers' pipe ends (a connection pickles while a process is being
  spawned). No sockets, threads, model or CURVE secret key travel.
- worker, ``init_on_receiver(model=policy, worker_idx=i)`` then ``connect()``: torchrl
  ships the policy's structure on the ``meta`` device, so the policy is first given real
  (CPU) storage, then ``connect()`` returns with version 1 (or newer) copied into it,
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
import multiprocessing
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
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
from tensordict import TensorDictBase
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

    def __init__(self, strategy: str, inner: _ZmqsyncScheme) -> None:
        with warnings.catch_warnings():
            # torchrl warns that ITS state_dict application is experimental; zmqsync
            # applies weights itself (checked, all-or-nothing), so it does not apply here.
            warnings.filterwarnings("ignore", "state_dict strategy is experimental", UserWarning)
            super().__init__(strategy)
        self._inner = inner
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
        state["_forward_lock"] = None
        state["_local_model"] = None
        state["_recorded"] = None
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

    @property
    def zmqsync_scheme(self) -> _ZmqsyncScheme:
        """The zmqsync scheme this one delegates to."""
        return self._inner

    def get_sender(self) -> WeightSender:
        """The zmqsync sender. ``RuntimeError`` before ``init_on_sender``."""
        return self._inner.get_sender()

    def get_receiver(self) -> WeightReceiver:
        """The zmqsync receiver. ``RuntimeError`` before ``init_on_receiver``."""
        return self._inner.get_receiver()

    def status(self) -> dict[str, Any]:
        """The sender's sync state (see :meth:`zmqsync.WeightSender.status`)."""
        if self._weightless:
            return {"model_id": self._model_id, "version": 0, "workers": [], "weightless": True}
        return self._inner.status()

    def worker_versions(self) -> dict[int, int]:
        """Worker id -> the newest version it acked (see
        :meth:`zmqsync.WeightSender.worker_versions`); empty for a weightless policy."""
        return {} if self._weightless else self._inner.worker_versions()

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
            sender = _built(self._inner.get_sender)
            if sender is not None:
                sender.model = model

    # --- sender side -----------------------------------------------------------------

    def _init_on_sender_impl(
        self,
        *,
        model_id: str = "policy",
        context: Any = None,
        model: Any = None,
        weights: Any = None,
        num_workers: int | None = None,
        ctx: Any = None,
        **kwargs: Any,
    ) -> None:
        """Start serving the workers and publish the current weights as version 1.

        ``ctx`` is torchrl's multiprocessing context (the pipe scheme makes its pipes
        with it).
        """
        self._model_id = model_id
        self.context = context
        if model is None and context is not None:
            model = _model_of(context, model_id)
        if num_workers is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        if model is None and weights is None:
            raise ValueError(
                f"{type(self).__name__}: no model {model_id!r} to take weights from: pass "
                "model=... or weights=..., or a context (collector) that holds the policy"
            )
        self._local_model = model
        if weights is None and _weightless(model):
            self._weightless = True  # nothing to send, ever: no sockets, pipes or threads
            return
        self._start_sender(
            model_id, model=model, num_workers=num_workers, context=context, ctx=ctx, **kwargs
        )
        release = self._releaser()
        try:
            # Version 1 becomes the snapshot that joining workers fetch (Clone pattern):
            # targeted at nobody, so nothing is waited for while workers still start.
            self._inner.get_sender().send(weights, worker_ids=[])
        except BaseException:
            release()
            raise
        if context is not None:
            # torchrl's multiprocess collectors never shut their schemes down: close the
            # sockets, pipes and threads at the latest when the collector is collected.
            weakref.finalize(context, release)

    def _start_sender(
        self,
        model_id: str,
        *,
        model: Any,
        num_workers: int | None,
        context: Any,
        ctx: Any,
        **kwargs: Any,
    ) -> None:
        """Initialise the inner scheme's sender. ``kwargs``: what torchrl passed beyond
        the common arguments (a Ray collector's ``remote_collectors``)."""
        raise NotImplementedError

    def _releaser(self) -> Callable[[], None]:
        """What closes this side's resources; it must not refer to ``self`` (it runs
        from a finalizer)."""
        return self._inner.shutdown

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
            self._inner.connect(timeout=self.connect_timeout)
            self._inner.send(weights)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Send weights; returns once every targeted worker applied them.

        ``weights``: ``None`` (the collector's policy), an ``nn.Module``, a
        ``TensorDict``, a ``dict`` of tensors, or the name of a model in the context.
        Raises :class:`zmqsync.SyncTimeout` naming workers that did not ack in time.
        A weightless policy has nothing to send: a no-op.
        """
        if self._weightless:
            return
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
        self._inner.send(weights, worker_ids)

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Start a send; :meth:`wait_async` completes it."""
        if not self._weightless:
            self._inner.send_async(weights, worker_ids)

    def wait_async(self) -> None:
        """Wait for the pending :meth:`send_async`."""
        if not self._weightless:
            self._inner.wait_async()

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
        self._worker_idx = worker_idx
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
        if tracker is None or version <= 0:
            return
        recorded = (id(tracker), epoch, version)
        if recorded == self._recorded:
            return
        self._recorded = recorded
        if getattr(tracker, "version_type", int) in (int, "int"):
            # torchrl counts updates: the initial weights are 0, two updates make 2.
            # zmqsync's learner publishes its initial weights as version 1, so version
            # v is the learner's (v - 1)-th update. Numbering by the learner's version,
            # not by updates this worker got, keeps equal numbers meaning equal weights
            # across workers (a worker skipped by worker_ids= jumps ahead); a restarted
            # learner (a new epoch) numbers from 0 again.
            tracker.version = version - 1
        else:
            tracker.increment_version()  # a uuid tracker: a fresh id per version

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
        deadline = time.monotonic() + self.connect_timeout
        self._inner.connect(worker_idx=worker_idx, timeout=self.connect_timeout)
        # The learner publishes version 1 in init_on_sender, so connect() normally
        # returns holding it; a learner built by hand may publish later.
        while receiver.version == 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SyncTimeout(
                    f"worker {receiver.worker_idx} connected to {self.endpoint} but no weights "
                    f"came within {self.connect_timeout:g}s: the learner has sent nothing yet"
                )
            receiver.receive(remaining)
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
        inner = getattr(self, "_inner", None)
        if inner is not None:
            inner.shutdown()
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
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
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
            connect_timeout=connect_timeout,
            **sender_options,
        )
        super().__init__(strategy, inner)

    @property
    def mode(self) -> str:
        """``"pubsub"`` or ``"router"``."""
        return self._inner.mode

    def _start_sender(
        self,
        model_id: str,
        *,
        model: Any,
        num_workers: int | None,
        context: Any,
        ctx: Any,
        **kwargs: Any,
    ) -> None:
        # ctx is unused: workers reach the learner over ZeroMQ, not torchrl's pipes.
        self._no_more(kwargs, "init_on_sender", type(self).__name__)
        self._inner.init_on_sender(model_id, model=model, num_workers=num_workers)


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
        **sender_options: Any,
    ) -> None:
        _check_retain_snapshot(sender_options)
        inner = _PipeScheme(
            strategy, timeout=timeout, connect_timeout=connect_timeout, **sender_options
        )
        super().__init__(strategy, inner)
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

    def _start_sender(
        self,
        model_id: str,
        *,
        model: Any,
        num_workers: int | None,
        context: Any,
        ctx: Any,
        **kwargs: Any,
    ) -> None:
        self._no_more(kwargs, "init_on_sender", type(self).__name__)
        if num_workers is None:
            raise ValueError(
                "MultiProcessWeightSyncScheme.init_on_sender needs the number of workers: "
                "pass num_workers=N, or a context (collector) with a num_workers attribute"
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
        try:
            self._inner.init_on_sender(
                model_id,
                pipes=[parent for parent, _ in pairs],
                model=model,
                num_workers=num_workers,
            )
        except BaseException:
            for parent, child in pairs:
                parent.close()
                child.close()
            self._worker_ends = {}
            raise

    def _releaser(self) -> Callable[[], None]:
        inner, ends = self._inner, self._worker_ends

        def release() -> None:
            _close_all(ends)
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
        **sender_options: Any,
    ) -> None:
        _check_retain_snapshot(sender_options)
        inner = _RayScheme(
            strategy,
            timeout=timeout,
            method=DELIVER_METHOD if method is None else method,
            poll_interval=poll_interval,
            connect_timeout=connect_timeout,
            **sender_options,
        )
        super().__init__(strategy, inner)
        self.method = method

    def _start_sender(
        self,
        model_id: str,
        *,
        model: Any,
        num_workers: int | None,
        context: Any,
        ctx: Any,
        remote_collectors: Any = None,
        **kwargs: Any,
    ) -> None:
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
        options = {} if num_workers is None else {"num_workers": num_workers}
        self._inner.init_on_sender(model_id, remote_collectors=actors, model=model, **options)

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
        sender = self._inner.get_sender()
        deadline = time.monotonic() + timeout
        while True:
            latest = sender.version
            # worker_versions(), not status(): status shows a large fleet's rows in part.
            behind = {w: v for w, v in sender.worker_versions().items() if v < latest}
            if not behind:
                return
            if time.monotonic() >= deadline:
                joined = sender.connected_workers()
                details = "; ".join(
                    f"worker {w} holds version {v}" + ("" if w in joined else " (never joined)")
                    for w, v in sorted(behind.items())
                )
                raise SyncTimeout(
                    f"{len(behind)} Ray actor(s) did not reach version {latest} of "
                    f"{self._model_id!r} within {timeout:g}s: {details}. Is each remote "
                    "collector alive, and did it get the scheme (register_scheme_receiver)?",
                    missing_workers=behind,
                    version=latest,
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
