"""NoWeightSyncScheme: weight synchronization switched off."""

from __future__ import annotations

from typing import Any

from zmqsync.schemes.base import WeightSyncScheme
from zmqsync.vocabulary import Metadata, Strategy, WorkerIds

__all__ = ["NoWeightSyncScheme"]


class NoOpTransport:
    """The transport of :class:`NoWeightSyncScheme`: moves nothing."""

    name = "none"
    closed = False

    def close(self) -> None:
        self.closed = True


class NoWeightSyncScheme(WeightSyncScheme):
    """No-op scheme: ``send``, ``receive`` and ``connect`` do nothing.

    Useful to switch synchronization off for one model without changing the code that
    drives the schemes.
    """

    def __init__(self, strategy: Strategy = "tensordict") -> None:
        super().__init__(strategy)
        self._initialised = False

    def create_transport(self, **kwargs: Any) -> NoOpTransport:  # type: ignore[override]
        """A transport that moves nothing."""
        return NoOpTransport()

    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        self._model_id = model_id
        self._context = context
        self._model = kwargs.get("model")

    def init_on_receiver(
        self, *, model_id: str = "policy", context: Any = None, **kwargs: Any
    ) -> None:
        self._model_id = model_id
        self._context = context
        self._model = kwargs.get("model")
        self._worker_idx = kwargs.get("worker_idx")

    def connect(self, *, worker_idx: int | None = None, timeout: float | None = None) -> None:
        """No-op synchronize: does nothing."""

    def send(
        self, weights: Any = None, worker_ids: WorkerIds = None, *, metadata: Metadata | None = None
    ) -> None:
        """No-op send: does nothing."""

    def send_async(
        self, weights: Any = None, worker_ids: WorkerIds = None, *, metadata: Metadata | None = None
    ) -> None:
        """No-op: does nothing."""

    def wait_async(self) -> None:
        """No-op: does nothing."""

    def update_weights(self, weights: Any = None) -> None:
        """No-op: does nothing."""

    def receive(self, timeout: float | None = None) -> None:
        """No-op receive: always returns None."""
        return None

    def worker_versions(self) -> dict[int, int]:
        """No workers are synchronized: always empty."""
        return {}
