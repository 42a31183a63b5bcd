"""zmqsync's ZeroMQ, pipe and Ray schemes as torchrl ``WeightSyncScheme`` classes."""

from __future__ import annotations

import multiprocessing
import time
import types
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from zmqsync.errors import SyncTimeout
from zmqsync.schemes.multiprocess import MultiProcessWeightSyncScheme as _PipeScheme
from zmqsync.schemes.ray import RayWeightSyncScheme as _RayScheme
from zmqsync.schemes.zmq import ZMQWeightSyncScheme as _ZMQScheme
from zmqsync.torchrl._collector import _CollectorScheme
from zmqsync.torchrl._plan import _STATUS_POLL
from zmqsync.transport.ray import DELIVER_METHOD, deliver
from zmqsync.vocabulary import Mode, Strategy

__all__ = ["MultiProcessWeightSyncScheme", "RayWeightSyncScheme", "ZMQWeightSyncScheme"]


class ZMQWeightSyncScheme(_CollectorScheme):
    """:class:`zmqsync.ZMQWeightSyncScheme` as a torchrl ``WeightSyncScheme``.

    Args:
        strategy: ``"tensordict"`` (default) or ``"state_dict"``.
        sync: whether ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted worker's ack.
        per_worker_weights: each worker has weights of its own (one sender per worker,
            each on an endpoint of its own).
        **options: every keyword :class:`zmqsync.ZMQWeightSyncScheme` takes, meaning the
            same: ``mode``, ``endpoint``, ``timeout`` (seconds ``send()`` waits for the
            acks before raising :class:`zmqsync.SyncTimeout`), the CURVE keys,
            ``insecure``, ``shared_memory``, ``connect_timeout`` (seconds a worker waits
            in ``connect()`` for the learner and its first version) and the sender's
            options (``heartbeat``, ``repair_after``, ...; ``retain_snapshot`` must stay
            ``True``: workers take their first weights from the snapshot); and
            ``apply_mode``, every worker's (see :class:`zmqsync.WeightReceiver`):
            ``"shared"`` makes each worker's policy read-only views of the learner's one
            copy in shared memory, over ``ipc://`` (see docs/shared.md).
    """

    _inner: _ZMQScheme

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        *,
        sync: bool = True,
        per_worker_weights: bool = False,
        **options: Any,
    ) -> None:
        endpoint = options.get("endpoint")
        if per_worker_weights and endpoint is not None:
            raise ValueError(
                "per_worker_weights=True serves each worker from an endpoint of its own: "
                f"leave endpoint=None (got {endpoint!r})"
            )
        super().__init__(
            _ZMQScheme, strategy, options, sync=sync, per_worker_weights=per_worker_weights
        )

    @property
    def mode(self) -> Mode:
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
        strategy: ``"tensordict"`` (default, as torchrl's own schemes) or ``"state_dict"``
            (which torchrl calls experimental, and warns of at every scheme it makes).
        sync: whether ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted worker's ack.
        per_worker_weights: each worker has weights of its own (one sender per worker).
        **options: every keyword :class:`zmqsync.MultiProcessWeightSyncScheme` takes,
            meaning the same: ``timeout`` (seconds ``send()`` waits for the acks before
            raising :class:`zmqsync.SyncTimeout`), ``connect_timeout`` (seconds a worker
            waits in ``connect()`` for the learner and its first version) and the
            sender's options (``heartbeat``, ``repair_after``, ...; ``retain_snapshot``
            must stay ``True``: workers take their first weights from the snapshot);
            and ``apply_mode``, every worker's (see :class:`zmqsync.WeightReceiver`):
            ``"shared"`` makes each worker's policy read-only views of the learner's one
            copy in shared memory (see docs/shared.md); ``lend_tensors``, the sender's
            and every worker's (on by default: the learner writes each version of 4 MiB
            and more straight into the tensors of the workers on its host; ``False``
            streams every version; see docs/streaming.md).

    Without a collector: ``init_on_sender(model_id, model=..., num_workers=N)``, start
    the workers with the scheme (``spawn`` or ``forkserver``), call ``connect()`` on the
    learner once they all started, and in worker ``i``
    ``init_on_receiver(model_id=..., model=..., worker_idx=i)`` then ``connect()``.
    """

    _inner: _PipeScheme

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        *,
        sync: bool = True,
        per_worker_weights: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(
            _PipeScheme, strategy, options, sync=sync, per_worker_weights=per_worker_weights
        )
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
            model_id=model_id,
            model=model,
            pipe=end,
            worker_idx=worker_idx,
            **self._receiver_options(),
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


def _deliver_in_actor(
    actor: Any, channel: str, peer_index: int, frames: Any, seq: int | None = None
) -> list[list[bytes]]:
    """Run by Ray inside a remote collector (``actor.__ray_call__``): hand one of the
    learner's calls to the receiver this process registered for ``channel``."""
    del actor  # the receiver is found by channel, not through the collector object
    return deliver(channel, peer_index, frames, seq)


class _RayCall:
    """What :class:`~zmqsync.transport.ray.RayHub` calls ``.remote(channel, index,
    frames)`` on: one actor's built-in ``__ray_call__``, running
    :func:`_deliver_in_actor` there."""

    def __init__(self, handle: Any) -> None:
        self._call = handle.__ray_call__

    def remote(self, channel: str, peer_index: int, frames: Any, seq: int | None = None) -> Any:
        # frames (maybe an ObjectRef into the object store) stays a top-level argument,
        # so Ray resolves it before the call runs, as for a method of the actor's own.
        return self._call.remote(_deliver_in_actor, channel, peer_index, frames, seq)


def _through_ray_call(handle: Any) -> Any:
    """``handle`` as the hub sees it: its delivery method goes through ``__ray_call__``."""
    return types.SimpleNamespace(**{DELIVER_METHOD: _RayCall(handle), "handle": handle})


class RayWeightSyncScheme(_CollectorScheme):
    """:class:`zmqsync.RayWeightSyncScheme` as a torchrl ``WeightSyncScheme``, for
    ``torchrl.collectors.distributed.RayCollector``.

    Args:
        strategy: ``"tensordict"`` (default, as torchrl's own schemes) or ``"state_dict"``
            (which torchrl calls experimental, and warns of at every scheme it makes).
        method: ``None`` (default): reach each actor through Ray's built-in
            ``__ray_call__``, which torchrl's remote collectors (any Ray actor) have. A
            name: call that method of the actor instead (an actor class that inherits
            :class:`zmqsync.WeightSyncActorMixin` has ``"zmqsync_deliver"``).
        sync: whether ``send()`` (``collector.update_policy_weights_()``) waits for
            every targeted actor's ack.
        per_worker_weights: each actor has weights of its own (one sender per actor).
        **options: every other keyword :class:`zmqsync.RayWeightSyncScheme` takes,
            meaning the same: ``timeout`` (seconds ``send()`` waits for the acks before
            raising :class:`zmqsync.SyncTimeout`, a killed actor for one),
            ``poll_interval``, ``shared_memory``, ``device_memory``, ``connect_timeout``
            (seconds the learner's ``connect()``, which torchrl calls before the first
            update, waits for every actor to hold the latest version) and the sender's
            options (``heartbeat``, ``repair_after``, ...; ``retain_snapshot`` must stay
            ``True``).

    A remote collector applies versions between its own method calls (a plain Ray actor
    runs one call at a time), so an update sent while it collects a batch lands when
    that batch is done; ``timeout`` must cover one batch.

    Under ``RayCollector``, ``init_on_sender(remote_collectors=)`` starts calling each
    remote collector actor; torchrl then ships the scheme to each actor
    (``register_scheme_receiver``), where ``init_on_receiver`` registers a receiver and
    returns at once. The learner's calls reach it through Ray's built-in
    ``__ray_call__``, which every Ray actor has, so torchrl's collector classes need no
    method of zmqsync's (a method added inside the actor later would be unknown to the
    learner's handle, and ``cascade_execute("_receiver_schemes[...]...")`` fails until
    torchrl has registered the scheme there): each call hands its frames to the receiver
    registered in that process (none yet: the call returns nothing), which applies a
    version and acks on the same call. The actor joins (hello, snapshot) through those
    calls, and torchrl's lazy ``connect()`` on the learner returns once every actor
    holds the latest version.
    """

    _inner: _RayScheme

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        *,
        method: str | None = None,
        sync: bool = True,
        per_worker_weights: bool = False,
        **options: Any,
    ) -> None:
        if "backend" in options:
            raise TypeError(
                "zmqsync.torchrl.RayWeightSyncScheme does not take backend=: it moves weights "
                "through Ray's calls and object store (and shared memory on one host), not "
                "a torch.distributed process group. Drop the argument."
            )
        options["method"] = DELIVER_METHOD if method is None else method
        super().__init__(
            _RayScheme, strategy, options, sync=sync, per_worker_weights=per_worker_weights
        )
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
