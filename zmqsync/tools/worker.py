"""An actor that builds its model from an importable factory and applies every version
a sender publishes (what ``zmqsync worker`` runs).

:func:`load_factory` and :func:`build_model` turn ``"package.module:make_model"`` into a
model, with errors that say what to fix; :class:`ModelWorker` follows the learner.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from zmqsync.closing import ClosesOnExit
from zmqsync.endpoints import check_connectable
from zmqsync.errors import FactoryError, SyncTimeout
from zmqsync.security import CurveClient
from zmqsync.vocabulary import Strategy

__all__ = ["ModelWorker", "build_model", "load_factory"]


def load_factory(spec: str) -> Any:
    """The object named by ``"package.module:attribute"`` (a model factory, usually).

    The current directory is importable, as with ``python -m``, so a ``models.py`` next
    to where the worker starts works as ``--model models:make_policy``.
    Raises :class:`FactoryError` saying what did not import and why.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(
            f"--model {spec!r} is not MODULE:FACTORY; write it as package.module:make_model"
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        where = "" if exc.name == module_name else f" (it needs {exc.name!r}, which is missing)"
        raise FactoryError(
            f"cannot import module {module_name!r} for --model {spec}{where}: install it, "
            "or run from the directory that holds it"
        ) from exc
    except Exception as exc:
        raise FactoryError(
            f"importing {module_name!r} for --model {spec} failed: {type(exc).__name__}: {exc}"
        ) from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean {module_name}:{close[0]}?" if close else ""
            raise FactoryError(f"module {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj


def build_model(spec: str) -> Any:
    """Build a model from a ``module:factory`` spec.

    The factory is called with no arguments and must return an ``nn.Module``, a
    ``TensorDict`` or a ``dict`` of tensors; a spec may also name such an object
    directly. Raises :class:`FactoryError`.
    """
    import torch
    from tensordict import TensorDictBase

    factory = load_factory(spec)
    model = factory
    if callable(factory) and not isinstance(factory, torch.nn.Module):
        try:
            model = factory()
        except Exception as exc:
            raise FactoryError(
                f"--model {spec}: calling the factory failed: {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(model, torch.nn.Module | TensorDictBase | Mapping):
        raise FactoryError(
            f"--model {spec} gave a {type(model).__name__}; the factory must return an "
            "nn.Module, a TensorDict or a dict of tensors"
        )
    return model


class ModelWorker(ClosesOnExit):
    """An actor that holds a model and applies every version a sender publishes.

    Args:
        endpoint: the sender's endpoint (what it printed).
        model: the model versions are applied to, in place.
        worker_idx: this worker's id, unique in the fleet.
        strategy: must match the sender's (``zmqsync serve`` uses ``"state_dict"``).
        timeout: seconds :meth:`connect` waits for the sender.
        curve: this worker's CURVE keys and the sender's public key, when the sender
            has CURVE keys.
        failover: other upstreams (relays, or the learner) to follow in turn when this
            one goes silent (the same CURVE keys serve them all).

    Example::

        worker = ModelWorker("tcp://127.0.0.1:5555", make_policy(), worker_idx=0)
        worker.connect()
        while True:
            version = worker.wait_for_version(timeout=1.0)
    """

    def __init__(
        self,
        endpoint: str,
        model: Any,
        *,
        worker_idx: int | None = 0,
        strategy: Strategy = "state_dict",
        timeout: float = 30.0,
        model_id: str = "policy",
        curve: CurveClient | None = None,
        failover: Sequence[str] = (),
    ) -> None:
        from zmqsync.schemes import ZMQWeightSyncScheme

        check_connectable(endpoint)
        for other in failover:
            check_connectable(other)
        if worker_idx is not None and worker_idx < 0:
            raise ValueError(f"worker_idx must be >= 0; got {worker_idx}")
        self.endpoint = endpoint
        self.model = model
        self.timeout = timeout
        self._scheme = ZMQWeightSyncScheme(
            strategy,
            endpoint=endpoint,
            timeout=timeout,
            curve_client=curve,
        )
        self._scheme.init_on_receiver(
            model_id=model_id, model=model, worker_idx=worker_idx, failover=list(failover)
        )
        self._receiver = self._scheme.get_receiver()
        self._rejections_seen = 0

    @property
    def version(self) -> int:
        """The version this worker holds (0 before the first)."""
        return self._receiver.version

    @property
    def metadata(self) -> dict[str, Any] | None:
        """What the learner attached to the version held now (``send(metadata=)``)."""
        return self._receiver.metadata

    @property
    def worker_idx(self) -> int | None:
        """This worker's id (assigned by the learner on connect when none was given)."""
        return self._receiver.worker_idx

    @property
    def lock(self) -> Any:
        """Hold it during a forward pass: no version is applied meanwhile."""
        return self._receiver.lock

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: bytes received, versions applied, duplicates, stale, rejected,
        and ``last_apply_s`` (seconds the last version took to apply)."""
        return dict(self._receiver.stats)

    def connect(self, timeout: float | None = None) -> int:
        """Join the sender and return the version applied.

        Raises :class:`SchemaMismatchError` (the receiver's, naming the offending key) as
        soon as the sender's weights are refused for not fitting this model, and
        :class:`SyncTimeout` if no sender answers.
        """
        timeout = self.timeout if timeout is None else timeout
        try:
            self._receiver.connect(timeout)
        except SyncTimeout as exc:
            raise SyncTimeout(
                f"no zmqsync sender answered at {self.endpoint} within {timeout:g}s: "
                "is the learner running, and is this the endpoint it printed?"
            ) from exc
        return self.version

    def wait_for_version(self, timeout: float = 1.0) -> int | None:
        """Wait up to ``timeout`` seconds for a new version; return it, or ``None``."""
        applied = self._receiver.receive(timeout)
        return None if applied is None else self.version

    def new_rejections(self) -> list[str]:
        """Reasons for messages this worker refused since the last call."""
        total = int(self._receiver.stats["rejected_frames"])
        fresh = total - self._rejections_seen
        self._rejections_seen = total
        if fresh <= 0:
            return []
        return list(self._receiver.rejections)[-fresh:]

    def close(self) -> None:
        """Leave the fleet. Idempotent; never waits on the sender."""
        self._scheme.shutdown()
