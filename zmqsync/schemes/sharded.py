"""A sharded learner's ranks agreeing on what makes them one sender: the epoch (rank 0's)
and every rank's endpoint, over their torch.distributed process group, once, at init.

No pickle: the endpoints travel as bytes in a tensor (``all_gather``), the epoch as an
integer tensor (``broadcast``).
"""

from __future__ import annotations

import datetime
from typing import Any, Final

import torch

from zmqsync.errors import SyncTimeout
from zmqsync.protocol import MAX_TEXT_CHARS
from zmqsync.sender.core import new_epoch
from zmqsync.tensors.dtensor import LocalPart

__all__ = ["UNSUPPORTED", "RankSetup", "check_options", "rank_setup"]

#: Sender options a sharded learner does not support, and why. (``delta=True`` and
#: ``wire_dtype=`` work: each rank digests and casts its own part.)
UNSUPPORTED: Final = {
    "share_params": (
        "a rank's part is boxes of its local shards, not its module's tensors laid out "
        "whole in one block that workers on its host could copy from; each rank already "
        "sends only its own 1/M of the model"
    ),
}


class RankSetup:
    """What this rank learned from its group: its part, the epoch, every endpoint."""

    def __init__(self, part: LocalPart, epoch: int, ranks: list[str]) -> None:
        self.part = part
        self.epoch = epoch
        self.ranks = ranks


def check_options(options: dict[str, Any]) -> None:
    """Refuse the sender options a sharded learner does not support."""
    for name, why in UNSUPPORTED.items():
        if options.get(name):
            raise ValueError(f"{name}= is not supported by a sharded learner ({why})")


def rank_setup(endpoint: str, group: Any = None, timeout: float = 120.0) -> RankSetup:
    """Called by every rank of ``group`` (None: the default group) once its hub is bound
    at ``endpoint``: a collective call, as FSDP's ``state_dict`` is. Raises
    :class:`SyncTimeout` if the other ranks do not all call it within ``timeout``
    seconds (the process group's own timeout may be half an hour)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "a model of DTensors is sent by every rank of its learner: initialise "
            "torch.distributed (or pass group=) before init_on_sender"
        )
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    device = _device(group)
    raw = endpoint.encode()
    if len(raw) > MAX_TEXT_CHARS:
        raise ValueError(f"endpoint is {len(raw)} bytes; the limit is {MAX_TEXT_CHARS}")
    mine = torch.zeros(MAX_TEXT_CHARS + 1, dtype=torch.uint8, device=device)
    mine[0 : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    _wait(dist.all_gather(everyone, mine, group=group, async_op=True), timeout, rank, size)
    ranks = [t.cpu().numpy().tobytes().rstrip(b"\0").decode() for t in everyone]
    epoch = torch.tensor([new_epoch() if rank == 0 else 0], dtype=torch.int64, device=device)
    first = 0 if group is None else dist.get_global_rank(group, 0)
    _wait(dist.broadcast(epoch, src=first, group=group, async_op=True), timeout, rank, size)
    return RankSetup(LocalPart(rank, size), int(epoch.item()), ranks)


def _wait(work: Any, timeout: float, rank: int, size: int) -> None:
    """Wait for a collective at most ``timeout`` seconds."""
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise SyncTimeout(
            f"rank {rank} of {size}: not every rank of the learner called init_on_sender "
            f"within {timeout:g}s ({str(exc)[:200]})"
        ) from exc


def _device(group: Any) -> torch.device:
    """Where the group's collectives take tensors (gloo: the CPU; nccl: this GPU)."""
    backend = torch.distributed.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
