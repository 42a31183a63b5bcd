"""What the ``zmqsync`` command line does, as a library: the CLI is a thin shell over this.

- :func:`query_status` asks a running sender for its sync state over its main endpoint
  (the same state ``WeightSender.status()`` returns in the learner's own process), and
  :func:`assess` says which workers are behind, missing or silent.
- :func:`load_checkpoint` and :class:`CheckpointPublisher`: a learner that publishes the
  tensors of a checkpoint file, and republishes when the file changes (``zmqsync serve``).
- :func:`build_model` and :class:`ModelWorker`: an actor that builds its model from an
  importable factory and applies every version it receives (``zmqsync worker``).
- :func:`demo_model` and :class:`LocalFleet`: a learner in this process and N worker
  processes on this host (``zmqsync demo``).
- :func:`create_curve_keypair`, :func:`curve_server_from_files`,
  :func:`curve_client_from_files`: ZeroMQ CURVE keys for endpoints other hosts can reach.

Nothing here imports typer or rich: the same calls work from a notebook or a script.
"""

from __future__ import annotations

import difflib
import importlib
import multiprocessing
import multiprocessing.process
import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import zmq

from zmqsync.errors import (
    CheckpointError,
    EndpointError,
    FactoryError,
    FrameError,
    SyncTimeout,
    TransportError,
    WeightsRejected,
    ZMQSyncError,
)
from zmqsync.protocol import ErrorMessage, StatusReply, StatusRequest, decode, encode
from zmqsync.security import CurveClient, CurveServer, write_keypair
from zmqsync.transport._zmq import is_loopback, parse_endpoint, translated

if TYPE_CHECKING:
    import torch

    from zmqsync.schemes import ZMQWeightSyncScheme

# torch (and the schemes, which need it) are imported where they are used: asking a
# sender for its status should not pay seconds of torch start-up.

__all__ = [
    "DEFAULT_SILENT_AFTER",
    "DEFAULT_STATUS_TIMEOUT",
    "CheckpointError",
    "CheckpointPublisher",
    "FactoryError",
    "LocalFleet",
    "ModelWorker",
    "PublishResult",
    "assess",
    "build_model",
    "check_connectable",
    "create_curve_keypair",
    "curve_client_from_files",
    "curve_server_from_files",
    "demo_model",
    "load_checkpoint",
    "load_factory",
    "query_status",
    "reachable_from_other_hosts",
    "worker_problem",
]

#: Seconds :func:`query_status` waits for a sender's answer. A sender answers from its
#: pump thread within milliseconds; seconds of silence mean nobody is there.
DEFAULT_STATUS_TIMEOUT: Final = 3.0
#: A worker the sender has not heard from for this long is reported as silent. Workers
#: send a heartbeat every second by default, so ten missed ones are not a hiccup.
DEFAULT_SILENT_AFTER: Final = 10.0
#: A worker's refusal reason quoted in :func:`worker_problem` (reasons can be long).
MAX_REASON_CHARS: Final = 200
#: How often :class:`LocalFleet` and :class:`CheckpointPublisher` look at progress.
POLL_INTERVAL: Final = 0.05
#: Hidden units of the demo MLP's input and output layers (its middle layer is sized to
#: reach the requested megabytes).
_DEMO_IN, _DEMO_OUT = 64, 16


def _sync_mode(mode: str) -> Literal["pubsub", "router"]:
    if mode not in ("pubsub", "router"):
        raise ValueError(f"mode must be 'pubsub' or 'router'; got {mode!r}")
    return cast(Literal["pubsub", "router"], mode)


def _strategy(strategy: str) -> Literal["state_dict", "tensordict"]:
    if strategy not in ("state_dict", "tensordict"):
        raise ValueError(f"strategy must be 'state_dict' or 'tensordict'; got {strategy!r}")
    return cast(Literal["state_dict", "tensordict"], strategy)


# --- status --------------------------------------------------------------------------


def check_connectable(endpoint: str) -> None:
    """Raise :class:`EndpointError` unless ``endpoint`` is an address one can connect to."""
    scheme, rest = parse_endpoint(endpoint)
    if scheme == "tcp" and rest.rsplit(":", 1)[1] in ("*", "0"):
        raise EndpointError(
            f"{endpoint} means 'any free port', which only a sender can bind; give the "
            "endpoint the sender printed when it started (tcp://HOST:PORT)"
        )


def query_status(
    endpoint: str,
    timeout: float = DEFAULT_STATUS_TIMEOUT,
    *,
    curve: CurveClient | None = None,
    context: zmq.Context[Any] | None = None,
) -> dict[str, Any]:
    """Ask the sender bound at ``endpoint`` for its sync state.

    Returns the dict of :meth:`zmqsync.WeightSender.status` (model_id, version, epoch,
    uptime, per-worker state, totals). Raises :class:`EndpointError` for an address that
    cannot be connected to, :class:`SyncTimeout` when nothing answers within ``timeout``
    seconds, and :class:`TransportError` when something answers that is not a zmqsync
    sender. The socket is closed with ``linger=0``: a dead sender never blocks the exit.
    A sender with CURVE keys answers only a client with ``curve`` keys it accepts.

    Example::

        state = query_status("tcp://127.0.0.1:5555")
        behind = assess(state)        # {} when every worker holds the latest version
    """
    check_connectable(endpoint)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds; got {timeout}")
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        with translated(f"asking {endpoint} for its status"):
            if curve is not None:
                curve.apply(sock)  # before connect(), or it does not take
            sock.sndtimeo = int(timeout * 1000)
            sock.connect(endpoint)
            try:
                sock.send_multipart(encode(StatusRequest()))
            except zmq.Again as exc:  # the request could not even be queued
                raise SyncTimeout(f"could not reach {endpoint} within {timeout:g}s") from exc
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise SyncTimeout(
                    f"no zmqsync sender answered at {endpoint} within {timeout:g}s: is the "
                    "learner running, and is this the endpoint it printed?"
                )
            frames = sock.recv_multipart(zmq.NOBLOCK)  # poll said it is there
    finally:
        sock.close(linger=0)
    try:
        message = decode(frames)
    except FrameError as exc:
        raise TransportError(
            f"something answered at {endpoint}, but not a zmqsync sender ({exc}); check the "
            "endpoint"
        ) from exc
    if isinstance(message, ErrorMessage):
        raise TransportError(
            f"the sender at {endpoint} refused the status request: {message.code}: "
            f"{message.message}"
        )
    if not isinstance(message, StatusReply):
        raise TransportError(
            f"the sender at {endpoint} answered a status request with a "
            f"{type(message).__name__}; is it running the same zmqsync version?"
        )
    return message.status


def worker_problem(
    worker: Mapping[str, Any], version: int, silent_after: float | None = DEFAULT_SILENT_AFTER
) -> str | None:
    """What is wrong with one worker of a status dict, in words; ``None`` if nothing."""
    w = worker["worker"]
    if not worker.get("connected"):
        return f"worker {w} has not connected"
    if worker.get("left"):
        # Gone on purpose: a problem only where the fleet has a fixed size that counts it.
        if not worker.get("expected"):
            return None
        ago = worker.get("since_left_s")
        when = "" if ago is None else f" {ago:.0f}s ago"
        return f"worker {w} left{when} (its receiver closed; sends to it fail until it is back)"
    held = int(worker.get("version", 0))
    if worker.get("torn"):
        doing = "being repaired" if worker.get("repairing") else "waiting for a repair"
        return (
            f"worker {w} is torn (a version's stream broke while it was written in place; "
            f"forward passes wait): {doing}, last whole version {held}"
        )
    if held < version:
        problem = f"worker {w} holds version {held} of {version} ({version - held} behind)"
        refusals = worker.get("rejections") or []
        if refusals:  # why it is behind, when it said so
            problem += f"; it refused: {str(refusals[-1])[:MAX_REASON_CHARS]}"
        return problem
    seen = worker.get("since_last_seen_s")
    if silent_after is not None and seen is not None and seen > silent_after:
        return f"worker {w} has been silent for {seen:.0f}s (is it still running?)"
    return None


def assess(
    status: Mapping[str, Any], *, silent_after: float | None = DEFAULT_SILENT_AFTER
) -> dict[int, str]:
    """``{worker: problem}`` for every worker that is behind, missing or silent.

    Empty when every worker holds the sender's current version: that is what
    ``zmqsync status`` exits 0 on. ``silent_after=None`` ignores silence.
    """
    version = int(status.get("version", 0))
    problems = {}
    for worker in status.get("workers", []):
        problem = worker_problem(worker, version, silent_after)
        if problem is not None:
            problems[int(worker["worker"])] = problem
    return problems


# --- checkpoints and the learner -----------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike[str], *, key: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file as a flat ``{dotted_name: tensor}`` dict.

    ``.safetensors`` files are read with safetensors; anything else with
    ``torch.load(weights_only=True)``, which never runs code from the file. Nested dicts
    are flattened to dotted names (as ``nn.Module.state_dict()`` names them); ``key``
    picks one entry first (``key="model"`` for ``{"model": state_dict, "step": 10}``).
    Raises :class:`CheckpointError` with what to do instead.
    """
    import torch

    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"checkpoint {p} does not exist: give the path of a .pt or .safetensors file "
            "(save one with torch.save(model.state_dict(), path))"
        )
    if not p.is_file():
        raise CheckpointError(f"checkpoint {p} is not a file")
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise CheckpointError(
                f"reading {p} needs the safetensors package: pip install 'zmqsync[safetensors]'"
            ) from exc
        try:
            obj: Any = load_file(str(p), device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError and OSErrors
            raise CheckpointError(f"cannot read {p} as safetensors: {exc}") from exc
    else:
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            if found is None:  # not a pickle torch would load at all: corrupt or garbage
                raise CheckpointError(
                    f"cannot read {p} as a torch checkpoint (the file is corrupt, or not "
                    "a .pt file)"
                ) from exc
            raise CheckpointError(
                f"{p} holds Python objects ({found[1]}) that torch.load(weights_only=True) "
                "refuses to unpickle (zmqsync never runs code from a checkpoint): save the "
                "tensors only, torch.save(model.state_dict(), path)"
            ) from exc
        except Exception as exc:  # torch.load of damaged bytes raises almost anything
            raise CheckpointError(
                f"cannot read {p} as a torch checkpoint ({type(exc).__name__}: {exc}); if "
                "it is being written, write it to a temporary name and rename it into place"
            ) from exc
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
            raise CheckpointError(f"{p} has no entry {key!r} (it has: {keys})")
        obj = obj[key]
    if isinstance(obj, torch.Tensor):
        raise CheckpointError(f"{p} holds a single tensor, not a dict of named tensors")
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{p} holds a {type(obj).__name__}, not a dict of tensors: save model.state_dict()"
        )
    flat: dict[str, torch.Tensor] = {}
    _flatten_into(flat, obj, (), p, top=obj)
    if not flat:
        raise CheckpointError(f"{p} holds no tensors")
    return flat


def _flatten_into(
    out: dict[str, torch.Tensor],
    obj: Mapping[Any, Any],
    prefix: tuple[str, ...],
    path: Path,
    *,
    top: Mapping[Any, Any],
) -> None:
    import torch

    for k, v in obj.items():
        name = (*prefix, str(k))
        if isinstance(v, Mapping):
            _flatten_into(out, v, name, path, top=top)
        elif isinstance(v, torch.Tensor):
            out[".".join(name)] = v
        else:
            dicts = [str(t) for t, sub in top.items() if isinstance(sub, Mapping)]
            hint = (
                f" use --key to pick the state_dict inside it ({', '.join(dicts)})"
                if dicts
                else " save model.state_dict() only"
            )
            raise CheckpointError(
                f"{path}: entry {'.'.join(name)!r} is a {type(v).__name__}, not a tensor;{hint}"
            )


def _file_signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@dataclass
class PublishResult:
    """How one publish went: the version, its size, and who did not take it."""

    version: int
    nbytes: int
    seconds: float
    targets: list[int]
    missing: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    message: str = ""

    @property
    def ok(self) -> bool:
        """True when every targeted worker applied this version."""
        return not self.missing and not self.rejected


class CheckpointPublisher:
    """A learner that publishes a checkpoint file's tensors and republishes on change.

    The weights travel with strategy ``"state_dict"`` (flat dotted names), so a worker's
    ``model.state_dict()`` names must match the checkpoint's.

    Args:
        path: the checkpoint file (``.pt``/``.pth`` or ``.safetensors``).
        endpoint: where to bind; ``tcp://HOST:*`` picks free ports.
        mode: ``"pubsub"`` or ``"router"`` (see :class:`ZMQWeightSyncScheme`).
        num_workers: workers ``0..N-1`` that every publish waits for; ``None`` waits for
            the workers that have connected.
        key: an entry of the checkpoint to publish (see :func:`load_checkpoint`).
        timeout: seconds a publish waits for acks; workers that miss it catch up from the
            sender's snapshot when they come back.
        curve: the sender's CURVE keys: required to bind an address other hosts can
            reach, unless ``insecure``.

    Example::

        with CheckpointPublisher("policy.pt", endpoint="tcp://127.0.0.1:5555") as pub:
            pub.start()
            while True:
                time.sleep(1.0)
                if pub.changed():
                    result = pub.publish()   # result.missing: workers that did not ack
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        endpoint: str | None = None,
        mode: str = "pubsub",
        num_workers: int | None = None,
        key: str | None = None,
        timeout: float = 30.0,
        model_id: str = "policy",
        curve: CurveServer | None = None,
        insecure: bool = False,
    ) -> None:
        from zmqsync.schemes import ZMQWeightSyncScheme

        self.path = Path(path)
        self.key = key
        self.model_id = model_id
        self.num_workers = num_workers
        self._endpoint = endpoint
        self._scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode=_sync_mode(mode),
            endpoint=endpoint,
            timeout=timeout,
            curve_server=curve,
            insecure=insecure,
        )
        self._published: tuple[int, int] | None = None
        self._started = False

    @property
    def endpoint(self) -> str:
        """The bound address workers and ``zmqsync status`` connect to."""
        return str(self._scheme.endpoint)

    @property
    def version(self) -> int:
        """The latest version published."""
        return self._scheme.get_sender().version

    def start(self) -> PublishResult:
        """Read the checkpoint, bind, and publish it as version 1.

        The checkpoint is read before binding, so a bad file fails before anything
        listens. Version 1 is kept for workers that connect later (they get it when they
        connect); it waits for no one.
        """
        if self._started:
            raise RuntimeError("this publisher was already started")
        if self._endpoint is not None:
            parse_endpoint(self._endpoint)
        signature = _file_signature(self.path)
        weights = load_checkpoint(self.path, key=self.key)
        self._scheme.init_on_sender(self.model_id, num_workers=self.num_workers)
        self._started = True
        started = time.monotonic()
        # An empty target list: the version exists (and is snapshotted for late joiners)
        # without waiting for workers that may not have started yet.
        self._scheme.send(weights, worker_ids=[])
        self._published = signature
        return PublishResult(1, _nbytes(weights), time.monotonic() - started, [])

    def changed(self) -> bool:
        """True when the file's mtime or size differs from what was last published."""
        signature = _file_signature(self.path)
        return signature is not None and signature != self._published

    def publish(self, progress: Callable[[int, int], None] | None = None) -> PublishResult:
        """Read the checkpoint again and send it to every worker; wait for their acks.

        ``progress(acked, targeted)`` is called as acks arrive. Workers that did not ack
        in time, or refused the version, are listed in the result rather than raised:
        a learner keeps publishing. Raises :class:`CheckpointError` if the file cannot
        be read (the previous version stays published; call again later).
        """
        sender = self._scheme.get_sender()
        # Remember the file as seen before reading it: a file that cannot be read is
        # reported once, not at every poll, and read again when it next changes.
        self._published = _file_signature(self.path)
        weights = load_checkpoint(self.path, key=self.key)
        nbytes = _nbytes(weights)
        if self.num_workers is not None:
            targets = list(range(self.num_workers))
        else:
            targets = sorted(sender.connected_workers())
        started = time.monotonic()
        sender.send_async(weights)
        version = sender.version
        result = PublishResult(version, nbytes, 0.0, targets)
        try:
            if progress is not None:
                self._report_progress(version, targets, started + sender.timeout, progress)
            sender.wait_async()
        except SyncTimeout as exc:
            result.missing = list(exc.missing_workers)
            result.message = str(exc)
        except WeightsRejected as exc:
            result.rejected = dict(exc.rejections)
            result.message = str(exc)
        result.seconds = time.monotonic() - started
        return result

    def _report_progress(
        self,
        version: int,
        targets: list[int],
        deadline: float,
        progress: Callable[[int, int], None],
    ) -> None:
        wanted = set(targets)
        while True:
            held = self._scheme.get_sender().worker_versions()
            acked = sum(1 for w in wanted if held.get(w, 0) >= version)
            progress(acked, len(wanted))
            if acked >= len(wanted) or time.monotonic() >= deadline:
                return
            time.sleep(POLL_INTERVAL)

    def status(self) -> dict[str, Any]:
        """The sender's sync state (what ``zmqsync status`` shows)."""
        return self._scheme.status()

    def close(self) -> None:
        """Stop serving and release the endpoint. Idempotent."""
        self._scheme.shutdown()

    def __enter__(self) -> CheckpointPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


# --- factories and the worker --------------------------------------------------------


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


class ModelWorker:
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
        strategy: str = "state_dict",
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
            _strategy(strategy),
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

    def __enter__(self) -> ModelWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the demo fleet ------------------------------------------------------------------


def demo_model(size_mb: float = 1.0, *, seed: int = 0) -> torch.nn.Module:
    """A three-layer float32 MLP of about ``size_mb`` megabytes (MiB) of weights."""
    import torch

    if size_mb <= 0:
        raise ValueError(f"size_mb must be positive; got {size_mb}")
    n = size_mb * 1024 * 1024 / 4
    # parameters = h*h + (IN + OUT + 1)*h + OUT: solve for the hidden width h.
    b = _DEMO_IN + _DEMO_OUT + 1
    hidden = max(1, int((-b + (b * b + 4 * n) ** 0.5) / 2))
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(_DEMO_IN, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, _DEMO_OUT),
    )


def _demo_worker(
    scheme: ZMQWeightSyncScheme, worker_idx: int, size_mb: float, stop: Any, timeout: float
) -> None:
    """A demo worker process: holds a demo model and applies versions until told to stop."""
    import torch

    torch.set_num_threads(1)  # N workers on a laptop: one core each is plenty
    parent = multiprocessing.process.parent_process()
    try:
        scheme.init_on_receiver(
            model_id="policy", model=demo_model(size_mb, seed=1 + worker_idx), worker_idx=worker_idx
        )
        scheme.connect(timeout=timeout)
        scheme.start_receiver_thread()
        # Stop when told to, or when the learner is gone (killed without cleaning up).
        while not stop.wait(0.2):
            if parent is not None and not parent.is_alive():
                break
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the learner cleans up
    finally:
        scheme.shutdown()


class LocalFleet:
    """A learner in this process and ``num_workers`` worker processes on this host.

    What ``zmqsync demo`` runs. The learner binds when the fleet is made; close it (or
    use ``with``) to stop the workers and unbind. Workers are ``spawn``\\ ed processes
    that receive the scheme (it pickles with its endpoint) and apply every version to
    their own MLP.

    Example::

        with LocalFleet(num_workers=4, size_mb=1) as fleet:
            fleet.start()
            for _ in range(3):
                seconds = fleet.step()       # one "training step", then a synced send
            print(fleet.status())
    """

    def __init__(
        self,
        num_workers: int = 4,
        *,
        size_mb: float = 1.0,
        mode: str = "pubsub",
        transport: str = "ipc",
        timeout: float = 60.0,
    ) -> None:
        from zmqsync.schemes import ZMQWeightSyncScheme

        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1; got {num_workers}")
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp'; got {transport!r}")
        self.num_workers = num_workers
        self.size_mb = size_mb
        self.timeout = timeout
        self.model = demo_model(size_mb)
        endpoint = "tcp://127.0.0.1:*" if transport == "tcp" else None
        self.scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode=_sync_mode(mode),
            endpoint=endpoint,
            timeout=timeout,
        )
        self.nbytes = sum(p.numel() * p.element_size() for p in self.model.state_dict().values())
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = self._ctx.Event()
        self._procs: list[Any] = []
        # Bind now, so status() works (and shows every worker missing) before start().
        self.scheme.init_on_sender("policy", model=self.model, num_workers=num_workers)

    @property
    def endpoint(self) -> str:
        """Where the learner listens (``zmqsync status`` can ask it)."""
        return str(self.scheme.endpoint)

    def start(self, on_progress: Callable[[], None] | None = None) -> None:
        """Start the worker processes and wait until every one has connected.

        ``on_progress()`` is called while waiting (to refresh a display). Raises
        :class:`SyncTimeout` if the workers do not connect within the timeout, and
        ``RuntimeError`` if a worker process dies first.
        """
        for i in range(self.num_workers):
            proc = self._ctx.Process(
                target=_demo_worker,
                name=f"zmqsync-demo-worker-{i}",
                args=(self.scheme, i, self.size_mb, self._stop, self.timeout),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        deadline = time.monotonic() + self.timeout
        while True:
            connected = self.scheme.get_sender().connected_workers()
            if len(connected) >= self.num_workers:
                return
            for i, proc in enumerate(self._procs):
                if proc.exitcode is not None:
                    raise RuntimeError(
                        f"demo worker {i} exited with code {proc.exitcode} before connecting"
                    )
            if time.monotonic() >= deadline:
                missing = set(range(self.num_workers)) - connected
                raise SyncTimeout(
                    f"demo workers {sorted(missing)} did not connect within {self.timeout:g}s; "
                    "the machine may be overloaded: try --timeout with more seconds",
                    missing_workers=missing,
                )
            if on_progress is not None:
                on_progress()
            time.sleep(POLL_INTERVAL)

    def step(self) -> float:
        """Change the weights (a stand-in for a training step), send them to every
        worker, and return the seconds the synced send took."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.99).add_(0.01)
        started = time.perf_counter()
        self.scheme.send()
        return time.perf_counter() - started

    def status(self) -> dict[str, Any]:
        """The learner's sync state (see :meth:`zmqsync.WeightSender.status`)."""
        return self.scheme.status()

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker process (terminate, then kill, the stubborn) and unbind.

        Idempotent; returns within about ``2 * timeout`` seconds whatever the workers do.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout / 2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout / 2)
        self._procs.clear()
        self.scheme.shutdown()

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- keys ----------------------------------------------------------------------------


def create_curve_keypair(
    directory: str | os.PathLike[str], name: str = "zmqsync", *, force: bool = False
) -> tuple[Path, Path]:
    """Write a ZeroMQ CURVE key pair: ``NAME.key`` (public) and ``NAME.key_secret``.

    The secret file is created readable by its owner only (mode 0600 from the start).
    Refuses to overwrite an existing pair unless ``force``. Returns
    ``(public_file, secret_file)``.
    """
    if not zmq.has("curve"):
        raise ZMQSyncError("this libzmq was built without CURVE support; install pyzmq's wheel")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name, like 'learner'")
    d = Path(directory)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if not force and (os.path.lexists(public) or os.path.lexists(secret)):  # links too
        raise FileExistsError(
            f"{public} or {secret} already exists; pick another --name, or --force to replace"
        )
    d.mkdir(parents=True, exist_ok=True)
    return write_keypair(d, name, force=force)


def curve_server_from_files(
    secret_file: str | os.PathLike[str] | None,
    allowed_clients_dir: str | os.PathLike[str] | None = None,
) -> CurveServer | None:
    """The sender's CURVE keys from ``zmqsync keys`` files; ``None`` without a secret file.

    ``allowed_clients_dir`` holds the public ``*.key`` files of the workers (and status
    clients) to accept; without it, any client with the server's public key may connect
    (encrypted, but not authenticated).
    """
    if secret_file is None:
        if allowed_clients_dir is not None:
            raise ValueError(
                "a directory of allowed client keys needs the sender's own secret key file too"
            )
        return None
    return CurveServer.from_files(secret_file, allowed_clients_dir=allowed_clients_dir)


def curve_client_from_files(
    secret_file: str | os.PathLike[str] | None,
    server_public_file: str | os.PathLike[str] | None,
) -> CurveClient | None:
    """A client's CURVE keys (its secret file and the sender's public key file), or
    ``None`` when neither is given. One without the other is an error."""
    if secret_file is None and server_public_file is None:
        return None
    if secret_file is None or server_public_file is None:
        raise ValueError(
            "CURVE needs both this side's secret key file (NAME.key_secret) and the "
            "sender's public key file (NAME.key)"
        )
    return CurveClient.from_files(secret_file, server_public_file=server_public_file)


def reachable_from_other_hosts(endpoint: str) -> bool:
    """True for a tcp endpoint on an address other than loopback (127.x, ::1, localhost)."""
    return not is_loopback(endpoint)
