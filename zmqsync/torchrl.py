"""zmqsync's schemes as torchrl ``WeightSyncScheme`` subclasses, for torchrl collectors.

torchrl's multiprocess collectors accept any ``torchrl.weight_update.WeightSyncScheme``
in ``weight_sync_schemes=``; this module offers zmqsync's under the same names and
arguments::

    from torchrl.collectors import MultiSyncCollector
    import zmqsync.torchrl

    collector = MultiSyncCollector(
        [make_env] * 2, policy, frames_per_batch=64, total_frames=-1,
        weight_sync_schemes={"policy": zmqsync.torchrl.ZMQWeightSyncScheme()},
    )
    ...train policy...
    collector.update_policy_weights_()                # every worker holds it on return
    collector.update_policy_weights_(worker_ids=[0])  # exactly worker 0

How a collector drives a scheme, and what each step does here:

- learner, ``init_on_sender(model_id=, context=collector, ctx=)``: binds the sockets and
  publishes the policy's current weights as version 1 (kept as the late-joiner snapshot;
  no worker is waited for).
- the scheme is pickled into each spawned worker (endpoint and settings only; the
  sender's CURVE secret key never leaves the learner).
- worker, ``init_on_receiver(model=policy, worker_idx=i)`` then ``connect()``: torchrl
  ships the policy's structure on the ``meta`` device, so the policy is first given real
  (CPU) storage, then ``connect()`` returns with version 1 (or newer) copied into it,
  and a background thread applies every later version.
- learner, ``update_policy_weights_(worker_ids=...)`` -> :meth:`ZMQWeightSyncScheme.send`:
  returns once every targeted worker applied the version, or raises
  :class:`zmqsync.SyncTimeout` naming those that did not (a killed worker, for one).

A forward pass of the worker's policy holds the receiver's lock (forward hooks), so it
never runs on half of a version.

Each class delegates to the zmqsync scheme of the same name (composition): the torchrl
class only adapts torchrl's calling conventions and bookkeeping.
"""

from __future__ import annotations

import copy
import time
import weakref
from typing import Any, Literal

try:
    from torchrl.weight_update import WeightSyncScheme as _TorchRLWeightSyncScheme
    from torchrl.weight_update.utils import _resolve_model
except ImportError as exc:  # pragma: no cover - exercised only without torchrl
    raise ImportError(
        "zmqsync.torchrl needs torchrl, which is not installed (or failed to import: "
        f"{exc}). Install it with `pip install 'zmqsync[torchrl]'` (or `pip install torchrl`), "
        "or use zmqsync.ZMQWeightSyncScheme directly without torchrl's collectors."
    ) from exc

import torch
from torch import nn

from zmqsync.errors import SyncTimeout
from zmqsync.receiver import WeightReceiver
from zmqsync.schemes.zmq import ZMQWeightSyncScheme as _ZMQScheme
from zmqsync.security import CurveClient, CurveServer
from zmqsync.sender import WeightSender

__all__ = ["ZMQWeightSyncScheme"]

#: Seconds a worker's ``connect()`` waits for the learner by default. Generous, because
#: under torchrl's ``spawn`` a worker connects while its siblings still import torch.
DEFAULT_CONNECT_TIMEOUT = 120.0


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


class ZMQWeightSyncScheme(_TorchRLWeightSyncScheme):
    """:class:`zmqsync.ZMQWeightSyncScheme` as a torchrl ``WeightSyncScheme``.

    Same arguments as :class:`zmqsync.ZMQWeightSyncScheme`, plus ``connect_timeout``.

    Args:
        strategy: ``"tensordict"`` (default) or ``"state_dict"``.
        mode: ``"pubsub"`` (fan-out) or ``"router"`` (addressed).
        endpoint: where the learner binds; ``None`` picks a free ipc path.
        timeout: seconds ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted worker's ack before raising :class:`zmqsync.SyncTimeout`.
        curve_server / curve_client / insecure: ZeroMQ CURVE, as in zmqsync.
        connect_timeout: seconds a worker waits in ``connect()`` for the learner and
            its first version.
        **sender_options: ``heartbeat``, ``repair_after``, ... (``retain_snapshot`` must
            stay ``True``: workers take their first weights from the snapshot).
    """

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
        if sender_options.get("retain_snapshot", True) is False:
            raise ValueError(
                "retain_snapshot=False cannot work with torchrl collectors: their workers "
                "take their first weights from the sender's snapshot. Leave it at True."
            )
        super().__init__(strategy)
        self._inner = _ZMQScheme(
            strategy,
            mode=mode,
            endpoint=endpoint,
            timeout=timeout,
            curve_server=curve_server,
            curve_client=curve_client,
            insecure=insecure,
            **sender_options,
        )
        self.connect_timeout = float(connect_timeout)
        self._forward_lock: _ForwardLock | None = None
        self._local_model: Any = None

    # --- pickling into spawned workers -----------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # copy.copy goes through the inner scheme's __getstate__: no sockets, threads,
        # model or secret key travel (torchrl also "re-pickles" a scheme in place).
        state["_inner"] = copy.copy(self._inner)
        state["_forward_lock"] = None
        state["_local_model"] = None
        return state

    # --- what the inner scheme knows -------------------------------------------------

    @property
    def endpoint(self) -> str | None:
        """Where the learner binds and workers connect (set by ``init_on_sender``)."""
        return self._inner.endpoint

    @property
    def timeout(self) -> float:
        """Seconds ``send()`` waits for acks."""
        return self._inner.timeout

    @property
    def mode(self) -> str:
        """``"pubsub"`` or ``"router"``."""
        return self._inner.mode

    @property
    def zmqsync_scheme(self) -> _ZMQScheme:
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
        return self._inner.status()

    @property
    def lock(self) -> Any:
        """The receiver's lock: no version is applied while it is held."""
        return self._inner.lock

    def create_transport(self, **kwargs: Any) -> Any:
        """A transport end of the inner scheme (``role="hub"`` or ``"spoke"``)."""
        return self._inner.create_transport(**kwargs)

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
        """Bind the sockets and publish the current weights as version 1.

        ``ctx`` (torchrl's multiprocessing context) is accepted and unused: workers reach
        the sender over ZeroMQ, not over torchrl's pipes or queues.
        """
        del ctx
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}.init_on_sender got unexpected arguments {sorted(kwargs)}"
            )
        self._model_id = model_id
        self.context = context
        if model is None and context is not None:
            model = _model_of(context, model_id)
        if num_workers is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        self._local_model = model
        self._inner.init_on_sender(model_id, model=model, num_workers=num_workers)
        if context is not None:
            # torchrl's collector.shutdown() never shuts its schemes down: close the
            # sockets and threads at the latest when the collector is collected.
            weakref.finalize(context, self._inner.shutdown)
        if model is None and weights is None:
            raise ValueError(
                f"{type(self).__name__}: no model {model_id!r} to take weights from: pass "
                "model=... or weights=..., or a context (collector) that holds the policy"
            )
        # Version 1 becomes the snapshot that connecting workers fetch (Clone pattern):
        # targeted at nobody, so nothing is waited for while workers still start.
        self._inner.get_sender().send(weights, worker_ids=[])

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any | None = None
    ) -> None:
        """Nothing to wait for: each worker fetches the latest version as it connects.

        With ``weights``, they are sent to every worker (waiting for them to connect).
        """
        if weights is not None:
            self._inner.connect(timeout=self.connect_timeout)
            self._inner.send(weights)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Send weights; returns once every targeted worker applied them.

        ``weights``: ``None`` (the collector's policy), an ``nn.Module``, a
        ``TensorDict``, a ``dict`` of tensors, or the name of a model in the context.
        Raises :class:`zmqsync.SyncTimeout` naming workers that did not ack in time.
        """
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
        self._inner.send_async(weights, worker_ids)

    def wait_async(self) -> None:
        """Wait for the pending :meth:`send_async`."""
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
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}.init_on_receiver got unexpected arguments {sorted(kwargs)}"
            )
        self._model_id = model_id
        self.context = context
        if model is None and context is not None:
            model = _model_of(context, model_id)
        model = _materialize(model)
        self._worker_idx = worker_idx
        self._local_model = model
        self._inner.init_on_receiver(model_id=model_id, model=model, worker_idx=worker_idx)

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        """Join the learner, return with real weights applied, then receive in the background."""
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
        self._forward_lock = _ForwardLock(receiver.lock)
        self._forward_lock.attach(receiver.model)
        self._inner.start_receiver_thread()

    def receive(self, timeout: float | None = None) -> Any:
        """Apply a new version if one came (``None`` if none did).

        Once connected, the background thread applies versions as they arrive, so this
        returns ``None`` at once: the model already holds the newest version received.
        """
        if not self.initialized_on_receiver:
            raise RuntimeError(f"{type(self).__name__}: receive() needs init_on_receiver() first")
        receiver = self._inner.get_receiver()
        if self.synchronized_on_receiver:
            return None  # the background thread receives for us
        return receiver.receive(timeout)

    # --- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the sockets, stop the background receiver, remove the hooks. Idempotent."""
        forward_lock, self._forward_lock = getattr(self, "_forward_lock", None), None
        if forward_lock is not None:
            forward_lock.detach()
        inner = getattr(self, "_inner", None)
        if inner is not None:
            inner.shutdown()
        super().shutdown()

    def __repr__(self) -> str:
        return f"zmqsync.torchrl.{self._inner!r}"


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


def _built(getter: Any) -> Any:
    """``getter()`` (the inner scheme's get_sender/get_receiver), or None before init."""
    try:
        return getter()
    except RuntimeError:
        return None
