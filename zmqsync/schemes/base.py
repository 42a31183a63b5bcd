"""WeightSyncScheme: torchrl's weight-sync API, on zmqsync's transports.

The scheme is what users hold. On the learner it builds a :class:`WeightSender` over a
hub transport (``init_on_sender``); in each worker it builds a :class:`WeightReceiver`
over a spoke (``init_on_receiver``, or its older name ``init_on_worker``). A scheme
initialised on the sender pickles (cloudpickle or pickle, for ``spawn``) into a worker
with its endpoint and settings, but not its sockets, threads or model::

    scheme = ZMQWeightSyncScheme()                      # learner
    scheme.init_on_sender("policy", model=policy, num_workers=4)
    ...spawn workers, passing `scheme`...
    scheme.receive()  /  scheme.init_on_receiver(model_id="policy", model=local_policy,
                                                  worker_idx=i); scheme.connect()
    scheme.send()                                       # learner: every worker updated
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Final

from tensordict import TensorDictBase

from zmqsync.errors import SyncTimeout
from zmqsync.receiver import WeightReceiver
from zmqsync.schemes.options import check_sender_options, model_from_context, receiver_options
from zmqsync.schemes.sharded import check_options, rank_setup
from zmqsync.schemes.weights import WeightStrategy, apply_to_model
from zmqsync.sender import WeightSender
from zmqsync.tensors.dtensor import distributed, is_sharded
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.transport import resolve
from zmqsync.transport.base import HubTransport, SpokeTransport
from zmqsync.vocabulary import Metadata, Strategy, WorkerIds, as_strategy

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "WeightSyncScheme"]

#: Seconds ``connect()`` waits by default, on either side (torchrl's default too).
#: Generous, because spawned workers connect only once they have imported torch, and
#: several of them import it at once; the send ``timeout`` is kept short to see dead
#: workers quickly, so it cannot serve for joining too.
DEFAULT_CONNECT_TIMEOUT: Final = 120.0
#: Seconds between looks at which workers have connected, while a sender's ``connect()``
#: waits for them.
WORKERS_POLL: Final = 0.01


class WeightSyncScheme:
    """Base of every scheme: torchrl's scheme surface, over a transport chosen by alias.

    Args:
        strategy: ``"state_dict"`` or ``"tensordict"``; both ends must agree.
        transport: alias of the transport (see :mod:`zmqsync.transport`).
        endpoint: where the sender binds and workers connect; ``None`` picks a free one.
        timeout: seconds ``send()`` waits for acks.
        connect_timeout: seconds ``connect()`` waits by default: on the sender for its
            ``num_workers`` workers to connect, in a worker for the sender and its
            latest version.
        sender_options: passed on to :class:`WeightSender` (``retain_snapshot``, ...).
    """

    _transport_alias = "memory"

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        *,
        transport: str | None = None,
        endpoint: str | None = None,
        timeout: float = 10.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        **sender_options: Any,
    ) -> None:
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be positive seconds; got {connect_timeout}")
        self.strategy = as_strategy(strategy)
        if transport is not None:
            self._transport_alias = transport
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        check_sender_options(type(self).__name__, sender_options)
        self.sender_options = sender_options
        self._model_id: str | None = None
        self._context: Any = None
        self._model: Any = None
        self._worker_idx: int | None = None
        self._num_workers: int | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None

    # --- pickling into spawned workers -----------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for runtime in ("_sender", "_receiver", "_context", "_model"):
            state[runtime] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- properties (torchrl's) ------------------------------------------------------

    @property
    def context(self) -> Any | None:
        """The context object (e.g. a collector), if one was given."""
        return self._context

    @property
    def model(self) -> Any | None:
        """The model this side synchronizes, if known."""
        return self._model

    @property
    def model_id(self) -> str | None:
        """Which model this scheme synchronizes."""
        return self._model_id

    @property
    def worker_idx(self) -> int | None:
        """This worker's index (receiver side; assigned by the sender if none was given)."""
        if self._receiver is not None:
            return self._receiver.worker_idx
        return self._worker_idx

    @property
    def weights(self) -> Any | None:
        """The current weights as a TensorDict (or dict, for ``state_dict``), if any."""
        if self._receiver is not None and self._model is None:
            return self._receiver.weights
        if self._model is None:
            return None
        return WeightStrategy(self.strategy).extract_weights(self._model)

    @property
    def sender_transports(self) -> dict[int, HubTransport]:
        """Per-worker transports; ZeroMQ schemes share one (see :attr:`shared_transport`)."""
        return {}

    @property
    def shared_transport(self) -> HubTransport | None:
        """The one hub every worker connects to (sender side)."""
        return self._sender.transport if self._sender is not None else None

    @property
    def receiver_transport(self) -> SpokeTransport | None:
        """This worker's transport (receiver side)."""
        return self._receiver.transport if self._receiver is not None else None

    # --- transports ------------------------------------------------------------------

    def _alias_for(self, endpoint: str | None) -> str:
        if endpoint is not None and endpoint.startswith("memory://"):
            return "memory"
        return self._transport_alias

    def create_transport(
        self, *, role: str = "hub", endpoint: str | None = None, **options: Any
    ) -> HubTransport | SpokeTransport:
        """A new transport end: the sender's ``"hub"`` or a worker's ``"spoke"``."""
        endpoint = endpoint if endpoint is not None else self.endpoint
        hub_cls, spoke_cls = resolve(self._alias_for(endpoint))
        if role == "hub":
            return hub_cls(endpoint, **options)  # type: ignore[call-arg]
        if role == "spoke":
            if endpoint is None:
                raise ValueError("a spoke needs the sender's endpoint: init the sender first")
            return spoke_cls(endpoint, **options)  # type: ignore[call-arg]
        raise ValueError(f"role must be 'hub' or 'spoke'; got {role!r}")

    # --- sender side -----------------------------------------------------------------

    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the sender: bind the transport and start serving workers.

        Args:
            model_id: which model (``"policy"``).
            context: optional object providing ``get_model(model_id)`` (or an attribute
                named ``model_id``) and ``num_workers``.
            **kwargs: ``model=``, ``num_workers=``, and any :class:`WeightSender` option;
                ``group=``: the process group of a sharded learner (default: the
                default group, when the model's tensors are DTensors).

        A model whose tensors are DTensors (FSDP2's ``fully_shard``, tensor parallel) is
        a sharded learner's: every rank of its process group calls this, each with the
        ``endpoint`` it binds, and becomes the sender of its own part of every version
        (see :mod:`zmqsync.schemes.sharded`); workers are given rank 0's endpoint.
        """
        if self._sender is not None:
            raise RuntimeError("init_on_sender() was already called on this scheme")
        self._take_model(model_id, context, kwargs)
        num_workers = kwargs.pop("num_workers", getattr(context, "num_workers", None))
        self._num_workers = num_workers
        group = kwargs.pop("group", None)
        sharded = group is not None or (
            self._model is not None
            and distributed()
            and is_sharded(ModelTensors(self.strategy).get(self._model))
        )
        if sharded:
            check_options({**self.sender_options, **kwargs})
        hub = self._open_hub(context, kwargs)  # takes what only the hub needs (pipes=)
        options = {**self.sender_options, **kwargs}
        try:
            if sharded:
                setup = rank_setup(hub.endpoint, group, self.connect_timeout)
                options.update(part=setup.part, epoch=setup.epoch, ranks=setup.ranks)
            self._sender = WeightSender(
                hub,
                num_workers=num_workers,
                mode=self._mode_name(),
                **self._settings(model_id),
                **options,
            )
        except BaseException:
            hub.close()
            raise
        self.endpoint = hub.endpoint

    def _take_model(self, model_id: str, context: Any, kwargs: dict[str, Any]) -> None:
        """Keep ``model_id``, ``context`` and the model: ``model=`` (popped from
        ``kwargs``), else the context's."""
        self._model_id = model_id
        self._context = context
        model = kwargs.pop("model", None)
        self._model = model if model is not None else model_from_context(context, model_id)

    def _settings(self, model_id: str) -> dict[str, Any]:
        """What this scheme's sender and receivers are built with, besides their options:
        the model kept by :meth:`_take_model`, and this scheme's strategy and timeout."""
        return {
            "model_id": model_id,
            "model": self._model,
            "strategy": self.strategy,
            "timeout": self.timeout,
        }

    def _given(self, kwargs: dict[str, Any], context: Any, name: str, what: str) -> Any:
        """``kwargs[name]`` (popped), else the context's attribute ``name``: ``what`` this
        scheme needs (a ValueError says so where neither has it)."""
        value = kwargs.pop(name, None)
        if value is None:
            value = getattr(context, name, None)
        if value is None:
            raise ValueError(
                f"{type(self).__name__} needs {what}: pass {name}=... or a context with a "
                f".{name} attribute"
            )
        return value

    def _open_hub(
        self, context: Any, kwargs: dict[str, Any], *, first_index: int = 0
    ) -> HubTransport:
        """This scheme's hub for :meth:`init_on_sender`.

        Pops from ``kwargs`` what only the hub needs (a pipe scheme's ``pipes=``, a Ray
        scheme's ``remote_collectors=``). Workers handed over as a list are numbered from
        ``first_index`` (a fleet numbers each transport's workers after the previous').
        """
        return self.create_transport(role="hub", **self._hub_options())  # type: ignore[return-value]

    def _adopt(self, sender: WeightSender, hub: HubTransport, model_id: str, model: Any) -> None:
        """Record that ``hub``, opened by :meth:`_open_hub`, is served by a fleet's
        ``sender`` (so this scheme pickles into its workers with the right address)."""
        self._model_id = model_id
        self._model = model
        self.endpoint = hub.endpoint  # as init_on_sender does

    def _hub_options(self) -> dict[str, Any]:
        """Extra constructor arguments for this scheme's hub transport."""
        return {}

    def _spoke_options(self) -> dict[str, Any]:
        """Extra constructor arguments for a worker's spoke transport."""
        return {}

    def _mode_name(self) -> str:
        return self._transport_alias

    def get_sender(self) -> WeightSender:
        """The sender. Raises ``RuntimeError`` before :meth:`init_on_sender`."""
        if self._sender is None:
            raise RuntimeError(
                f"{type(self).__name__}: init_on_sender() has not been called yet on this scheme"
            )
        return self._sender

    def create_sender(self) -> WeightSender:
        """The sender, initialising it with defaults if needed (legacy)."""
        if self._sender is None:
            self.init_on_sender(self._model_id or "policy", self._context, model=self._model)
        return self.get_sender()

    def send(
        self, weights: Any = None, worker_ids: WorkerIds = None, *, metadata: Metadata | None = None
    ) -> None:
        """Send weights; returns once every targeted worker applied them. ``metadata``
        (a small JSON-able dict) travels with the version: ``receiver.metadata``."""
        self.get_sender().send(weights, worker_ids, metadata=metadata)

    def send_async(
        self, weights: Any = None, worker_ids: WorkerIds = None, *, metadata: Metadata | None = None
    ) -> None:
        """Start a send; :meth:`wait_async` completes it."""
        self.get_sender().send_async(weights, worker_ids, metadata=metadata)

    def wait_async(self) -> None:
        """Wait for the pending :meth:`send_async`."""
        self.get_sender().wait_async()

    def update_weights(self, weights: Any = None) -> None:
        """Send to all workers (legacy)."""
        self.get_sender().update_weights(weights)

    def status(self) -> dict[str, Any]:
        """The sender's sync state (see :meth:`WeightSender.status`)."""
        return self.get_sender().status()

    def worker_versions(self) -> dict[int, int]:
        """Worker id -> the newest version it acked (see
        :meth:`WeightSender.worker_versions`)."""
        return self.get_sender().worker_versions()

    # --- receiver side ---------------------------------------------------------------

    def init_on_receiver(
        self, *, model_id: str = "policy", context: Any = None, **kwargs: Any
    ) -> None:
        """Set up a worker: build its receiver (``connect()`` then joins the fleet).

        Args:
            model_id: which model.
            context: optional object providing the model (``get_model(model_id)``).
            **kwargs: ``model=``, ``worker_idx=`` (omit it, or pass ``None``, and the
                sender assigns the lowest free id when the worker connects); and
                :class:`WeightReceiver`'s ``apply_mode=`` (``"auto"``, ``"staged"``,
                ``"in_place"``), ``chunk_timeout=`` and ``sink=`` (a callable taking
                ``(name, tensor)`` lists in place of a model: an inference engine's
                ``load_weights``); ``failover=``: other upstreams' endpoints (relays,
                or the learner), followed in turn when this one goes silent;
                ``slices=``: what a tensor-parallel worker holds of each tensor (see
                :class:`WeightReceiver`), of a sharded learner's.
        """
        if self._receiver is not None:
            raise RuntimeError("init_on_receiver() was already called on this scheme")
        if self.endpoint is None:
            raise RuntimeError(
                "this scheme has no endpoint: call init_on_sender() first (and pass the scheme "
                "to the worker), or give the scheme endpoint=..."
            )
        self._take_model(model_id, context, kwargs)
        worker_idx = kwargs.pop("worker_idx", self._worker_idx)
        self._worker_idx = None if worker_idx is None else int(worker_idx)
        options = receiver_options(kwargs)
        failover = [str(e) for e in kwargs.pop("failover", ())]
        if kwargs:
            raise TypeError(f"unexpected arguments for init_on_receiver: {sorted(kwargs)}")
        if failover:
            # Spokes to the other upstreams, made (with this scheme's keys) when needed;
            # this one comes round again after them.
            options["failover"] = [
                functools.partial(
                    self.create_transport, role="spoke", endpoint=e, **self._spoke_options()
                )
                for e in [*failover, self.endpoint]
            ]
        spoke_options = self._spoke_options()

        def connect_rank(endpoint: str) -> SpokeTransport:
            # A sharded learner's other ranks, which rank 0's Welcome names.
            return self.create_transport(role="spoke", endpoint=endpoint, **spoke_options)  # type: ignore[return-value]

        options["connect_rank"] = connect_rank
        spoke = self.create_transport(role="spoke", **spoke_options)
        try:
            self._receiver = WeightReceiver(
                spoke,  # type: ignore[arg-type]
                worker_idx=self._worker_idx,
                **self._settings(model_id),
                **options,
            )
        except BaseException:
            spoke.close()  # a refused option leaves no socket behind
            raise

    def init_on_worker(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Older name of :meth:`init_on_receiver` (``model_id`` may be positional)."""
        self.init_on_receiver(model_id=model_id, context=context, **kwargs)

    def get_receiver(self) -> WeightReceiver:
        """The receiver. Raises ``RuntimeError`` before :meth:`init_on_receiver`."""
        if self._receiver is None:
            raise RuntimeError(
                f"{type(self).__name__}: init_on_receiver()/init_on_worker() has not been "
                "called yet on this scheme"
            )
        return self._receiver

    def create_receiver(self) -> WeightReceiver:
        """The receiver, initialising it with defaults if needed (legacy)."""
        if self._receiver is None:
            self.init_on_receiver(
                model_id=self._model_id or "policy",
                context=self._context,
                model=self._model,
                worker_idx=self._worker_idx or 0,
            )
        return self.get_receiver()

    def connect(self, *, worker_idx: int | None = None, timeout: float | None = None) -> None:
        """Join up. A worker returns with the latest weights applied; a sender returns
        once its ``num_workers`` workers have connected (else raises SyncTimeout).

        ``timeout`` defaults to :attr:`connect_timeout`, not the send ``timeout``."""
        if self._receiver is not None:
            if worker_idx is not None and self._receiver.worker_idx is None:
                self._receiver.worker_idx = worker_idx
            elif worker_idx is not None and worker_idx != self._receiver.worker_idx:
                raise ValueError(
                    f"this receiver was initialised as worker {self._receiver.worker_idx}, "
                    f"not {worker_idx}"
                )
            self._receiver.connect(self.connect_timeout if timeout is None else timeout)
            return
        if self._sender is not None:
            self._wait_for_workers(self.connect_timeout if timeout is None else timeout)
            return
        raise RuntimeError("connect() needs init_on_sender() or init_on_receiver() first")

    def _wait_for_workers(self, timeout: float) -> None:
        """Wait for workers ``0..num_workers-1`` to connect. A sender that keeps no copy
        of the published version 0 (``retain_snapshot=False``) reads it from the model
        as each worker is served: then also wait until they hold it, so that the model
        does not change (the learner is blocked here) while it streams to them; and if
        the model changed in place since it was published, publish it anew (it holds
        still meanwhile), so that they get the weights the learner has now."""
        sender = self.get_sender()
        expected = set(range(sender.num_workers or 0))
        deadline = time.monotonic() + timeout
        while True:
            missing, what = expected - sender.connected_workers(), "connect"
            if not missing and not sender.retain_snapshot and sender.version == 0:
                if sender.published_changed:
                    with contextlib.suppress(RuntimeError):  # a send came first: fine
                        sender.publish()
                missing = expected - sender.current_workers()
                what = "take the learner's weights (version 0)"
            if not missing:
                return
            if time.monotonic() > deadline:
                raise SyncTimeout(
                    f"workers {sorted(missing)} did not {what} within {timeout:g}s",
                    missing_workers=missing,
                )
            time.sleep(WORKERS_POLL)

    def receive(self, timeout: float | None = None) -> Any:
        """Wait for a new version, apply it, return it (``None`` on timeout)."""
        return self.get_receiver().receive(timeout)

    def start_receiver_thread(self) -> None:
        """Apply new versions in a background thread, under :attr:`lock`."""
        self.get_receiver().start()

    @property
    def lock(self) -> Any:
        """Hold during a forward pass: no version is applied meanwhile."""
        return self.get_receiver().lock

    # --- local helpers (torchrl's) ---------------------------------------------------

    def prepare_weights(
        self, weights: Any, model_id: str, strategy: WeightStrategy | Strategy, context: Any = None
    ) -> Any:
        """Resolve ``weights`` (None -> the context's or scheme's model) to a TensorDict
        or state_dict, ready to send."""
        name = strategy if isinstance(strategy, str) else strategy.extract_as
        if weights is None:
            weights = model_from_context(context, model_id) if context is not None else self._model
        if isinstance(weights, str):
            weights = model_from_context(context if context is not None else self._context, weights)
        return WeightStrategy(name).extract_weights(weights)

    def apply_weights(self, weights: TensorDictBase | dict[str, Any], inplace: bool = True) -> None:
        """Apply ``weights`` to this side's model (all-or-nothing)."""
        if self._model is None:
            raise RuntimeError("this scheme has no model to apply weights to")
        apply_to_model(self._model, weights, self.strategy, inplace=inplace)

    # --- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the sender or receiver and their transports. Safe to call twice."""
        sender, self._sender = self._sender, None
        receiver, self._receiver = self._receiver, None
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()

    def __enter__(self) -> WeightSyncScheme:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        side = "sender" if self._sender else "receiver" if self._receiver else "idle"
        return (
            f"{type(self).__name__}(strategy={self.strategy!r}, endpoint={self.endpoint!r}, "
            f"model_id={self._model_id!r}, {side})"
        )
