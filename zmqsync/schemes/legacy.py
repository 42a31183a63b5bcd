"""MultiProcessedRemoteWeightUpdate: torchrl's legacy collector-side weight updater.

It copies the server's weights into each worker's own (``policy_weights``, in this
process: tensors in shared memory that torchrl's worker processes read). Each
destination is the model of a :class:`~zmqsync.WeightReceiver` on the in-process memory
transport (no bytes cross a process), fed by one :class:`~zmqsync.WeightSender`: every
push is a version, applied whole or not at all after a key/dtype/shape check, and acked.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from zmqsync.closing import ClosesOnExit
from zmqsync.receiver import WeightReceiver
from zmqsync.sender import WeightSender
from zmqsync.transport.memory import MemoryHub, MemorySpoke
from zmqsync.vocabulary import Strategy

__all__ = ["MultiProcessedRemoteWeightUpdate"]


class MultiProcessedRemoteWeightUpdate(ClosesOnExit):
    """Updates each worker's copy of the policy weights from the server's weights.

    Args:
        get_server_weights: returns the latest weights (a ``TensorDict``, a ``dict`` of
            tensors or an ``nn.Module``); ``None`` if there is nothing to fetch (then
            ``push_weights`` needs the weights passed in).
        policy_weights: ``{worker_id: weights}``, each worker's weights, updated in place.
            Worker ids are whatever the collector uses (devices, process indices).
        timeout: seconds a push waits for every targeted worker's copy.
        strategy: how weights are matched: ``"tensordict"`` (nested keys, default) or
            ``"state_dict"`` (dotted keys).

    Example::

        updater = MultiProcessedRemoteWeightUpdate(
            get_server_weights=lambda: TensorDict.from_module(policy),
            policy_weights={torch.device("cpu"): shared_weights},
        )
        updater.push_weights()            # every worker's weights == the server's
        updater.close()
    """

    def __init__(
        self,
        get_server_weights: Callable[[], Any] | None,
        policy_weights: Mapping[Hashable, Any],
        *,
        timeout: float = 10.0,
        strategy: Strategy = "tensordict",
    ) -> None:
        if not isinstance(policy_weights, Mapping) or not policy_weights:
            raise ValueError(
                "policy_weights must be a non-empty {worker_id: weights} mapping; got "
                f"{type(policy_weights).__name__}"
            )
        self.weights_getter = get_server_weights
        self._policy_weights = policy_weights
        self._index = {worker: i for i, worker in enumerate(policy_weights)}
        self._collector: weakref.ref[Any] | None = None
        self.post_hooks: list[Callable[[], None]] = []
        self._hub = MemoryHub()
        # No snapshot: workers here never join late, so a copy for them would be waste.
        self._sender = WeightSender(
            self._hub,
            model_id="policy",
            strategy=strategy,
            num_workers=len(self._index),
            timeout=timeout,
            retain_snapshot=False,
        )
        self._receivers: list[WeightReceiver] = []
        try:
            for worker, i in self._index.items():
                receiver = WeightReceiver(
                    MemorySpoke(self._hub.endpoint),
                    model_id="policy",
                    model=policy_weights[worker],
                    strategy=strategy,
                    worker_idx=i,
                    timeout=timeout,
                )
                self._receivers.append(receiver)
                receiver.connect()
        except BaseException:
            self.close()
            raise

    # --- torchrl's surface ------------------------------------------------------------

    def all_worker_ids(self) -> list[Hashable]:
        """Every worker's id (device or process), in ``policy_weights``'s order."""
        return list(self._policy_weights)

    def register_collector(self, collector: Any) -> None:
        """Register the collector this updater serves. A second registration raises
        ``RuntimeError``: one updater serves one collector."""
        if self._collector is not None:
            raise RuntimeError(
                "a collector is already registered with this updater; create one "
                "MultiProcessedRemoteWeightUpdate per collector"
            )
        self._collector = weakref.ref(collector)

    @property
    def collector(self) -> Any | None:
        """The registered collector, or ``None`` (none registered, or it was deleted)."""
        return None if self._collector is None else self._collector()

    def _get_server_weights(self) -> Any | None:
        """The latest weights from ``get_server_weights`` (``None`` without a getter)."""
        if self.weights_getter is None:
            return None
        weights = self.weights_getter()
        if isinstance(weights, TensorDictBase):
            return weights.data  # detached: what is copied, not the autograd graph
        return weights

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        """Map server weights before distribution: nothing to do here (a hook for
        subclasses)."""
        return server_weights

    def _sync_weights_with_worker(
        self, worker_id: Hashable | None = None, server_weights: Any = None
    ) -> None:
        """Copy ``server_weights`` into one worker's weights (all workers if ``None``).

        Returns once the worker holds them; raises :class:`~zmqsync.WeightsRejected` if
        they do not fit its weights, :class:`~zmqsync.SyncTimeout` if it did not apply
        them in time.
        """
        if server_weights is None:
            return
        self._send(server_weights, None if worker_id is None else [worker_id])

    def push_weights(
        self, policy_or_weights: Any = None, worker_ids: Hashable | Iterable[Hashable] | None = None
    ) -> None:
        """Update the targeted workers (all by default) from ``policy_or_weights``, or
        from ``get_server_weights()`` when it is ``None``; then run the post hooks."""
        weights = self._get_server_weights() if policy_or_weights is None else policy_or_weights
        weights = self._maybe_map_weights(weights)
        if weights is None:
            return
        targets = self._targets(worker_ids)
        if (
            type(self)._sync_weights_with_worker
            is MultiProcessedRemoteWeightUpdate._sync_weights_with_worker
        ):
            self._send(weights, targets)  # one version for all: flattened once
        else:  # a subclass decides per worker, as with torchrl's updaters
            for worker in targets:
                self._sync_weights_with_worker(worker_id=worker, server_weights=weights)
        for hook in self.post_hooks:
            hook()

    __call__ = push_weights

    def register_post_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every push."""
        self.post_hooks.append(hook)

    # --- zmqsync's extras -------------------------------------------------------------

    @property
    def version(self) -> int:
        """How many versions have been pushed."""
        return self._sender.version

    def status(self) -> dict[str, Any]:
        """The sync state (see :meth:`zmqsync.WeightSender.status`); worker ``i`` is the
        ``i``-th of :meth:`all_worker_ids`."""
        return self._sender.status()

    def _targets(self, worker_ids: Hashable | Iterable[Hashable] | None) -> list[Hashable]:
        if worker_ids is None:
            return self.all_worker_ids()
        if isinstance(worker_ids, int | torch.device | str) or not isinstance(worker_ids, Iterable):
            return [worker_ids]
        return list(worker_ids)

    def _send(self, weights: Any, workers: list[Hashable] | None) -> None:
        targets = self.all_worker_ids() if workers is None else workers
        unknown = [w for w in targets if w not in self._index]
        if unknown:
            raise ValueError(
                f"unknown worker(s) {unknown}; this updater serves {self.all_worker_ids()}"
            )
        indices = sorted({self._index[w] for w in targets})
        # Sender and receivers share this thread: queue the version to every target, let
        # each apply and ack it, then collect the acks.
        self._sender.send_async(weights, worker_ids=indices)
        for i in indices:
            self._receivers[i].poll()
        self._sender.wait_async()

    def close(self) -> None:
        """Stop the sender and the receivers. Safe to call twice."""
        for receiver in self._receivers:
            receiver.close()
        self._sender.close()
