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
import zipfile
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
#: A checkpoint's tensors may add up to at most this many times its file's size. Each
#: publish copies every tensor, so this bounds what a file can make ``serve`` hold. Tied
#: weights (an embedding shared with the output layer) name the same bytes twice; a file
#: naming one storage thousands of times, from a few kilobytes, is refused.
MAX_EXPANSION: Final = 4


def load_checkpoint(
    path: str | os.PathLike[str], *, key: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file as a flat ``{dotted_name: tensor}`` dict.

    ``.safetensors`` files are read with safetensors; anything else with
    ``torch.load(weights_only=True)``, which never runs code from the file. Nested dicts
    are flattened to dotted names (as ``nn.Module.state_dict()`` names them); ``key``
    picks one entry first (``key="model"`` for ``{"model": state_dict, "step": 10}``).
    Every tensor must be dense CPU data of its own in the file, and all of them at most
    :data:`MAX_EXPANSION` times the file's size: expanded or overlapping views, compressed
    zip entries and the like are refused before anything is copied.
    Raises :class:`CheckpointError` with what to do instead.
    """
    import torch

    file = Path(path)
    contents, size = _read(file)
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
    budget = _Budget(file, bytes_left=MAX_EXPANSION * size, entries_left=size)
    _flatten_into(flat, contents, (), budget, top=contents, path=set())
    if not flat:
        raise CheckpointError(f"{file} holds no tensors")
    return flat


def _read(file: Path) -> tuple[Any, int]:
    """What a checkpoint file holds, on the CPU (safetensors' dict, or what
    ``torch.load(weights_only=True)`` gives), and the size of the file it was read from."""
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
            # safetensors checks every tensor against the file and has no shared views.
            return load_file(str(file), device="cpu"), file.stat().st_size
        except Exception as exc:  # safetensors raises its own SafetensorError and OSErrors
            raise CheckpointError(f"cannot read {file} as safetensors: {exc}") from exc
    try:
        # One open file for the size, the zip check and the load: a file renamed into
        # place meanwhile cannot pair one file's size with another's contents.
        with file.open("rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            _refuse_compressed(stream, file)
            return torch.load(stream, map_location="cpu", weights_only=True), size
    except CheckpointError:
        raise
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


def _refuse_compressed(stream: Any, file: Path) -> None:
    """Refuse a zip checkpoint with a compressed entry, then rewind ``stream``.

    ``torch.save`` stores its entries uncompressed, so its storages are no larger than
    the file; ``torch.load`` inflates a deflated one all the same, and a megabyte of
    deflated zeros is a gigabyte, materialised before any tensor can be looked at.
    """
    packed: list[str] = []
    try:
        if zipfile.is_zipfile(stream):
            stream.seek(0)
            with zipfile.ZipFile(stream) as archive:
                packed = [i.filename for i in archive.infolist() if i.compress_type]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointError(f"cannot read {file} as a torch checkpoint ({exc})") from exc
    if packed:
        raise CheckpointError(
            f"{file} has compressed entries ({packed[0]}), which torch.save never writes "
            "and which could inflate to any size: save it with torch.save"
        )
    stream.seek(0)


@dataclass
class _Budget:
    """What is left for the tensors of one checkpoint (see :data:`MAX_EXPANSION`)."""

    file: Path
    bytes_left: int
    #: Entries: every real one costs its name and more bytes of the file, and a dict
    #: referenced from many places (pickle's memo) would otherwise multiply them.
    entries_left: int


def _flatten_into(
    out: dict[str, torch.Tensor],
    tree: Mapping[Any, Any],
    prefix: tuple[str, ...],
    budget: _Budget,
    *,
    top: Mapping[Any, Any],
    path: set[int],
) -> None:
    """Add ``tree``'s tensors to ``out`` under dotted names, each checked to be dense,
    within ``budget``; ``top``: the whole checkpoint, to suggest a ``--key`` when an
    entry is not a tensor; ``path``: the ids of the dicts above, to refuse a cycle."""
    import torch

    file = budget.file
    if id(tree) in path:
        raise CheckpointError(f"{file}: entry {'.'.join(prefix)!r} contains itself")
    path.add(id(tree))
    for entry, value in tree.items():
        name = (*prefix, str(entry))
        budget.entries_left -= 1
        if budget.entries_left < 0:
            raise CheckpointError(f"{file} names more entries than it has bytes")
        if isinstance(value, Mapping):
            _flatten_into(out, value, name, budget, top=top, path=path)
        elif isinstance(value, torch.Tensor):
            budget.bytes_left -= _dense_nbytes(".".join(name), value, file)
            if budget.bytes_left < 0:
                raise CheckpointError(
                    f"{file}'s tensors add up to more than {MAX_EXPANSION} times its size "
                    "(its entries name the same bytes many times): save each tensor once"
                )
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
    path.discard(id(tree))


def _dense_nbytes(name: str, tensor: torch.Tensor, file: Path) -> int:
    """``tensor``'s logical size in bytes, once it is known to be a CPU tensor whose
    elements are distinct bytes of its storage; else :class:`CheckpointError`.

    A stride-0 (expanded) or overlapping view of a few stored bytes names as many
    elements as it likes: copying it would make gigabytes of a kilobyte file.
    """
    import torch

    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise CheckpointError(
            f"{file}: tensor {name!r} is a {tensor.layout} tensor on {tensor.device}, not a "
            "dense one with its data in the file: save dense CPU tensors"
        )
    itemsize = tensor.element_size()
    logical = tensor.numel() * itemsize
    if logical == 0:
        return 0
    stored = tensor.untyped_storage().nbytes()
    # Sizes above 1 by stride: each dimension must step past all of the smaller ones.
    dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride(), strict=True) if n > 1)
    span, overlapping = 1, False
    for stride, n in dims:
        overlapping = overlapping or stride < span
        span = stride * (n - 1) + span
    end = (tensor.storage_offset() + span) * itemsize
    if overlapping or logical > stored or end > stored:
        raise CheckpointError(
            f"{file}: tensor {name!r} ({list(tensor.shape)}, strides {list(tensor.stride())}) "
            f"names {logical} bytes but its storage holds {stored}: an expanded or "
            "overlapping view is refused; save dense tensors (tensor.contiguous().clone())"
        )
    return logical


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
