"""What the transports benchmark compares: its variants by name (zmqsync's, each a
transport and scheme options, and the peers), where each one's workers live, and the
targets the tables judge zmqsync by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

#: Variant (and session) names, shared by the learner's side and the workers'.
PIPE: Final = "zmqsync-pipe"
TORCHRL_MP: Final = "torchrl-mp"
TORCHRL_SHM: Final = "torchrl-shm"
ZMQ: Final = "zmqsync-zmq"
ZMQSYNC_RAY: Final = "zmqsync-ray"
TORCHRL_RAY: Final = "torchrl-ray"
RAY_STORE: Final = "ray-store"
GLOO: Final = "gloo-flat"
MEMCPY: Final = "memcpy"


@dataclass(frozen=True)
class ZmqsyncSpec:
    """One zmqsync variant: its transport and the options its scheme is set up with.

    ``scheme`` goes to the scheme's constructor (``MultiProcessWeightSyncScheme(
    "state_dict", timeout=..., **scheme)``; ``--no-retain`` adds
    ``retain_snapshot=False``), ``sender`` to the learner's ``init_on_sender``,
    ``receiver`` to each worker's ``init_on_worker``/``init_on_receiver``. ``replaces``
    names the torchrl scheme it is compared with pairwise (a column of its own).
    """

    transport: Literal["pipe", "ray", "zmq"]
    replaces: str | None = None
    scheme: Mapping[str, Any] = field(default_factory=dict)
    sender: Mapping[str, Any] = field(default_factory=dict)
    receiver: Mapping[str, Any] = field(default_factory=dict)
    #: Whether its workers hold read-only views of one shared copy of each version
    #: (``apply_mode="shared"``) rather than tensors of their own.
    shares: bool = False


#: ``zmqsync-pipe`` with ``share_params=True``: workers copy from the learner's tensors.
PIPE_SHARE: Final = "zmqsync-pipe-share"
#: ``zmqsync-pipe`` whose workers map one read-only copy (``apply_mode="shared"``).
PIPE_SHARED: Final = "zmqsync-pipe-shared"
#: ``zmqsync-pipe`` whose workers lend their tensors whatever the version's size
#: (``lend_tensors=True`` on both sides; by default they lend from 4 MiB up): the learner
#: writes each version straight into them, one copy per worker.
PIPE_LENT: Final = "zmqsync-pipe-lent"
#: ``zmqsync-zmq`` (over ``ipc://``) whose workers lend their tensors, as ``PIPE_LENT``.
ZMQ_LENT: Final = "zmqsync-zmq-lent"
#: ``zmqsync-ray`` whose actors (on the learner's host) lend their tensors, as ``PIPE_LENT``.
RAY_LENT: Final = "zmqsync-ray-lent"
#: ``zmqsync-pipe`` that streams every version (``lend_tensors=False``, the default
#: before 2026-12-05): the learner writes it into shared memory, each worker copies it out.
PIPE_STREAM: Final = "zmqsync-pipe-stream"
#: ``zmqsync-zmq`` (over ``ipc://``) that streams every version, as ``PIPE_STREAM``.
ZMQ_STREAM: Final = "zmqsync-zmq-stream"
#: ``zmqsync-ray`` that streams every version, as ``PIPE_STREAM``.
RAY_STREAM: Final = "zmqsync-ray-stream"
#: Both sides' options of the variants that stream every version.
_STREAM: Final = {"lend_tensors": False}
#: zmqsync's variants, in the order a cell runs them. Another is one entry, e.g.
#: ``"zmqsync-pipe-share": ZmqsyncSpec("pipe", TORCHRL_MP, scheme={"share_params": True})``.
ZMQSYNC: Final[dict[str, ZmqsyncSpec]] = {
    PIPE: ZmqsyncSpec("pipe", replaces=TORCHRL_MP),
    PIPE_SHARE: ZmqsyncSpec("pipe", replaces=TORCHRL_MP, scheme={"share_params": True}),
    PIPE_SHARED: ZmqsyncSpec("pipe", receiver={"apply_mode": "shared"}, shares=True),
    PIPE_LENT: ZmqsyncSpec(
        "pipe", replaces=TORCHRL_MP, sender={"lend_tensors": True}, receiver={"lend_tensors": True}
    ),
    ZMQSYNC_RAY: ZmqsyncSpec("ray", replaces=TORCHRL_RAY),
    RAY_LENT: ZmqsyncSpec(
        "ray", replaces=TORCHRL_RAY, sender={"lend_tensors": True}, receiver={"lend_tensors": True}
    ),
    ZMQ: ZmqsyncSpec("zmq"),
    ZMQ_LENT: ZmqsyncSpec("zmq", sender={"lend_tensors": True}, receiver={"lend_tensors": True}),
    PIPE_STREAM: ZmqsyncSpec("pipe", replaces=TORCHRL_MP, sender=_STREAM, receiver=_STREAM),
    RAY_STREAM: ZmqsyncSpec("ray", replaces=TORCHRL_RAY, sender=_STREAM, receiver=_STREAM),
    ZMQ_STREAM: ZmqsyncSpec("zmq", sender=_STREAM, receiver=_STREAM),
}
#: The other variants, in the order a cell runs them after zmqsync's.
PEERS: Final = (TORCHRL_MP, TORCHRL_SHM, TORCHRL_RAY, RAY_STORE, GLOO, MEMCPY)
#: Every variant, in the order a cell runs them (then the reverse).
VARIANTS: Final = (*ZMQSYNC, *PEERS)
#: Variants that move the learner's tensors (``share_params``): the peers alias those
#: tensors (torchrl's schemes read them through a module and a TensorDict over the same
#: storage), so these run only without peers, in a run of their own.
MOVES_TENSORS: Final = frozenset({PIPE_SHARE})
#: What runs by default: every variant but those.
DEFAULT_VARIANTS: Final = tuple(v for v in VARIANTS if v not in MOVES_TENSORS)
#: The peers a zmqsync variant must beat: the fastest of these in a cell is its "best
#: peer" (memcpy is the bound, not a peer).
BEST_PEER_FROM: Final = (TORCHRL_MP, TORCHRL_SHM, TORCHRL_RAY, RAY_STORE, GLOO)
#: Each zmqsync variant and the torchrl scheme it replaces.
PAIRS: Final = tuple((name, spec.replaces) for name, spec in ZMQSYNC.items() if spec.replaces)
#: Where each variant's workers live: "pool" (the worker processes), "ray" (the actors),
#: or "learner" (none: memcpy).
WHERE: Final[dict[str, str]] = {
    **{name: "ray" if spec.transport == "ray" else "pool" for name, spec in ZMQSYNC.items()},
    TORCHRL_MP: "pool",
    TORCHRL_SHM: "pool",
    GLOO: "pool",
    TORCHRL_RAY: "ray",
    RAY_STORE: "ray",
    MEMCPY: "learner",
}
#: The issue's targets: zmqsync at or below torchrl everywhere (ratio <= 1)...
RATIO_TARGET: Final = 1.0
#: ...and at least this many times faster on the model of many small tensors...
SPEEDUP_TARGET: Final = 10.0
SMALL_TENSORS: Final = "2000x4KB"
#: ...at or below this fraction of the best peer's time in every cell...
BEST_PEER_TARGET: Final = 0.9
#: ...and at most this many times memcpy's time in this cell (size, K).
MEMCPY_TARGET: Final = 1.3
MEMCPY_CELL: Final = ("128MB", 1)
#: Timed sends per variant and cell, by size (``--repeats`` sets them all; the slow
#: sizes then get a fifth, at least 2: torchrl takes seconds per send there).
DEFAULT_REPEATS: Final[dict[str, int]] = {"1MB": 30, "16MB": 16, "128MB": 6, "2000x4KB": 6}
SLOW_SIZES: Final = ("128MB", SMALL_TENSORS)
