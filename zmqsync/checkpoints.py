"""A learner that publishes a checkpoint file's tensors, and republishes on change.

:func:`load_checkpoint` reads ``.pt`` or ``.safetensors`` files as flat
``{dotted_name: tensor}`` dicts without running code from them;
:class:`CheckpointPublisher` serves them (what ``zmqsync serve`` runs).
"""

from __future__ import annotations

import os
import pickle
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from zmqsync.closing import ClosesOnExit
from zmqsync.endpoints import parse_endpoint
from zmqsync.errors import CheckpointError, SyncTimeout, WeightsRejected
from zmqsync.security import CurveServer
from zmqsync.vocabulary import Mode

if TYPE_CHECKING:
    import torch

# torch (and the schemes, which need it) are imported where they are used: the CLI
# imports this module to start any command, and most commands never need torch.

__all__ = ["CheckpointPublisher", "PublishResult", "load_checkpoint"]

#: Seconds between looks at the workers' acks while a publish reports progress.
PROGRESS_POLL: Final = 0.05


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

    file = Path(path)
    contents = _read(file)
    if key is not None:
        if not isinstance(contents, Mapping) or key not in contents:
            keys = (
                ", ".join(map(str, contents))
                if isinstance(contents, Mapping)
                else type(contents).__name__
            )
            raise CheckpointError(f"{file} has no entry {key!r} (it has: {keys})")
        contents = contents[key]
    if isinstance(contents, torch.Tensor):
        raise CheckpointError(f"{file} holds a single tensor, not a dict of named tensors")
    if not isinstance(contents, Mapping):
        raise CheckpointError(
            f"{file} holds a {type(contents).__name__}, not a dict of tensors: save "
            "model.state_dict()"
        )
    flat: dict[str, torch.Tensor] = {}
    _flatten_into(flat, contents, (), file, top=contents)
    if not flat:
        raise CheckpointError(f"{file} holds no tensors")
    return flat


def _read(file: Path) -> Any:
    """What a checkpoint file holds, on the CPU: safetensors' dict, or what
    ``torch.load(weights_only=True)`` gives."""
    import torch

    if not file.exists():
        raise CheckpointError(
            f"checkpoint {file} does not exist: give the path of a .pt or .safetensors file "
            "(save one with torch.save(model.state_dict(), path))"
        )
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file} is not a file")
    if file.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise CheckpointError(
                f"reading {file} needs the safetensors package: pip install 'zmqsync[safetensors]'"
            ) from exc
        try:
            return load_file(str(file), device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError and OSErrors
            raise CheckpointError(f"cannot read {file} as safetensors: {exc}") from exc
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:  # not a pickle torch would load at all: corrupt or garbage
            raise CheckpointError(
                f"cannot read {file} as a torch checkpoint (the file is corrupt, or not a .pt file)"
            ) from exc
        raise CheckpointError(
            f"{file} holds Python objects ({found[1]}) that torch.load(weights_only=True) "
            "refuses to unpickle (zmqsync never runs code from a checkpoint): save the "
            "tensors only, torch.save(model.state_dict(), path)"
        ) from exc
    except Exception as exc:  # torch.load of damaged bytes raises almost anything
        raise CheckpointError(
            f"cannot read {file} as a torch checkpoint ({type(exc).__name__}: {exc}); if "
            "it is being written, write it to a temporary name and rename it into place"
        ) from exc


def _flatten_into(
    out: dict[str, torch.Tensor],
    tree: Mapping[Any, Any],
    prefix: tuple[str, ...],
    file: Path,
    *,
    top: Mapping[Any, Any],
) -> None:
    """Add ``tree``'s tensors to ``out`` under dotted names; ``top``: the whole
    checkpoint, to suggest a ``--key`` when an entry is not a tensor."""
    import torch

    for entry, value in tree.items():
        name = (*prefix, str(entry))
        if isinstance(value, Mapping):
            _flatten_into(out, value, name, file, top=top)
        elif isinstance(value, torch.Tensor):
            out[".".join(name)] = value
        else:
            dicts = [str(k) for k, sub in top.items() if isinstance(sub, Mapping)]
            hint = (
                f" use --key to pick the state_dict inside it ({', '.join(dicts)})"
                if dicts
                else " save model.state_dict() only"
            )
            raise CheckpointError(
                f"{file}: entry {'.'.join(name)!r} is a {type(value).__name__}, not a tensor;{hint}"
            )


def _file_signature(path: Path) -> tuple[int, int] | None:
    """The file's (mtime, size): what changes when it is rewritten; None if it is gone."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


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


class CheckpointPublisher(ClosesOnExit):
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
        mode: Mode = "pubsub",
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
            mode=mode,
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
            time.sleep(PROGRESS_POLL)

    def status(self) -> dict[str, Any]:
        """The sender's sync state (what ``zmqsync status`` shows)."""
        return self._scheme.status()

    def close(self) -> None:
        """Stop serving and release the endpoint. Idempotent."""
        self._scheme.shutdown()


def _nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())
