"""The models the sync-latency and transports benchmarks send: layouts by size, state
dicts of them on the benchmark's device, and a digest to check a worker's copy by.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import torch

#: Bytes in the benchmark's "MB" (the issue's sizes are powers of two in practice).
MIB: Final = 1024 * 1024


@dataclass(frozen=True)
class Layout:
    """A state_dict layout: ``count`` float32 tensors of shape ``shape``."""

    name: str
    count: int
    shape: tuple[int, ...]

    @property
    def tensor_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * 4

    @property
    def nbytes(self) -> int:
        return self.count * self.tensor_bytes

    def key_names(self) -> list[str]:
        return [f"layer{i}.weight" for i in range(self.count)]

    def describe(self) -> str:
        return f"{self.count} x float32{list(self.shape)}"


#: The issue's sizes. The three "MB" models are a few equal weight matrices, the way a
#: policy's linear layers are; "2000x4KB" is many tiny tensors (norms, biases, heads).
SIZES: Final[dict[str, Layout]] = {
    "1MB": Layout("1MB", 4, (256, 256)),
    "16MB": Layout("16MB", 8, (1024, 512)),
    "128MB": Layout("128MB", 16, (2048, 1024)),
    "2000x4KB": Layout("2000x4KB", 2000, (1024,)),
}


#: Where the learner's and every worker's tensors live: ``cpu`` or ``cuda`` (spawned
#: workers read it from the environment, which ``--device`` sets).
DEVICE_ENV: Final = "ZMQSYNC_BENCH_DEVICE"


def bench_device() -> str:
    return os.environ.get(DEVICE_ENV, "cpu")


def make_state_dict(layout: Layout, *, fill: str) -> dict[str, torch.Tensor]:
    """A state_dict of ``layout`` on :func:`bench_device`: random values (the learner) or
    zeros (a worker)."""
    gen = torch.Generator().manual_seed(1234)
    out = {}
    for key in layout.key_names():
        if fill == "random":
            out[key] = torch.randn(layout.shape, generator=gen)
        else:
            out[key] = torch.zeros(layout.shape)
    device = bench_device()
    return out if device == "cpu" else {k: v.to(device) for k, v in out.items()}


def digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A digest of a state_dict's bytes, read in place (no copy of CPU tensors)."""
    h = hashlib.blake2b(digest_size=16)
    for key, tensor in state_dict.items():
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().data.cast("B"))
    return h.hexdigest()


def bump(model: dict[str, torch.Tensor], step: int) -> None:
    """Make the next send a new version: in place, one tensor, no allocation."""
    tensors = list(model.values())
    tensors[step % len(tensors)].add_(1)


def describe_models(sizes: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The JSON's record of the models of ``sizes``."""
    return {s: {"bytes": SIZES[s].nbytes, "layout": SIZES[s].describe()} for s in sizes}
