"""torchrl's ``init_on_sender`` keyword forms (:class:`_Plan`), and per-worker weights
(:class:`_Fanout`: one zmqsync scheme per worker)."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from tensordict import TensorDictBase

from zmqsync.errors import SyncTimeout
from zmqsync.schemes.base import WeightSyncScheme as _ZmqsyncScheme
from zmqsync.torchrl._model import _model_of, _weightless
from zmqsync.vocabulary import WorkerIds

#: How often a learner waiting for its workers looks at where they stand.
_STATUS_POLL: Final = 0.01


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


#: The keywords that say what a torchrl scheme's ``init_on_sender`` publishes, and to
#: how many workers (see :meth:`_Plan.resolve`).
_FORMS: Final = ("model", "weights", "params_map", "devices", "device_map_fn", "num_workers")


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

    def _sends(self, weights: Any, worker_ids: WorkerIds) -> dict[int, Any]:
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

    def send_async(self, weights: Any = None, worker_ids: WorkerIds = None) -> None:
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

    def send(self, weights: Any = None, worker_ids: WorkerIds = None) -> None:
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
