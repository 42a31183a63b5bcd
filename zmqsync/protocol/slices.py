"""The slices a worker declares in its Hello (a tensor-parallel worker holds one box of
each tensor), as JSON and back: a strict parse, since every rank of a sharded learner
cuts each version by them, so a hostile declaration must cost it nothing to refuse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zmqsync.errors import FrameError
from zmqsync.protocol.limits import MAX_NDIM, MAX_SLICES, MAX_TENSOR_BYTES, MAX_TEXT_CHARS
from zmqsync.protocol.messages import Slice

__all__ = ["decode_slices", "encode_slices"]


def encode_slices(slices: Sequence[Slice]) -> list[list[Any]]:
    """``slices`` as the JSON a Hello carries: ``[key, shape, offsets, extent]`` each."""
    return [[list(s.key), list(s.shape), list(s.offsets), list(s.extent)] for s in slices]


def decode_slices(raw: Any) -> tuple[Slice, ...]:
    """The slices of a Hello's JSON, checked: at most :data:`MAX_SLICES`, one per tensor,
    each a box inside its global tensor, whose global tensor is no larger than one may
    be. Raises :class:`FrameError` for anything else."""
    if type(raw) is not list or len(raw) > MAX_SLICES:
        raise FrameError(f"Hello.slices must be a list of at most {MAX_SLICES} slices")
    out: list[Slice] = []
    seen: set[tuple[str, ...]] = set()
    for item in raw:
        s = _slice(item)
        if s.key in seen:
            raise FrameError(f"Hello.slices names tensor {s.dotted_key!r:.80} twice")
        seen.add(s.key)
        out.append(s)
    return tuple(out)


def _slice(item: Any) -> Slice:
    if not (type(item) is list and len(item) == 4):
        raise FrameError(f"a slice is [key, shape, offsets, extent]: {item!r:.80}")
    key, shape, offsets, extent = item
    if not (
        type(key) is list
        and 0 < len(key) <= MAX_NDIM
        and all(type(k) is str and 0 < len(k) <= MAX_TEXT_CHARS for k in key)
    ):
        raise FrameError(f"a slice's key must be a non-empty list of names: {key!r:.80}")
    name = ".".join(key)
    dims = (shape, offsets, extent)
    if not all(type(v) is list and len(v) == len(shape) <= MAX_NDIM for v in dims) or not all(
        type(d) is int and 0 <= d <= MAX_TENSOR_BYTES for v in dims for d in v
    ):
        raise FrameError(
            f"slice of {name!r:.80}: shape, offsets and extent must be lists of as many "
            f"non-negative ints (at most {MAX_NDIM}): {item[1:]!r:.80}"
        )
    if math.prod(d or 1 for d in shape) > MAX_TENSOR_BYTES:
        raise FrameError(f"slice of {name!r:.80}: its global shape {shape!r:.80} is too large")
    if any(o + n > d for d, o, n in zip(shape, offsets, extent, strict=True)):
        raise FrameError(
            f"slice of {name!r:.80}: extent {extent!r:.80} at offsets {offsets!r:.80} does "
            f"not fit in the global shape {shape!r:.80}"
        )
    return Slice(tuple(key), tuple(shape), tuple(offsets), tuple(extent))
