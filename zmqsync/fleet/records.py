"""What the fleet core works with: where a message came from, the effects it asks
its shell to carry out, a worker's session, and a version on its way."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from zmqsync.protocol import MAX_BELOW, Message, worker_id_key
from zmqsync.protocol.wire import U64_MAX
from zmqsync.transport.base import PeerId

__all__ = [
    "REASONS_KEPT",
    "REASON_CHARS",
    "Admit",
    "Effect",
    "FanOut",
    "Forget",
    "Origin",
    "Reply",
    "Send",
    "SendLatest",
    "Session",
    "parse_below",
]

#: Rejection reasons kept per worker and for the sender, and the length each is cut to.
REASONS_KEPT: Final = 8
REASON_CHARS: Final = 300


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a message came from: a hub and its peer, or ``peer=None`` for the ack
    channel, where nobody is identified."""

    hub: int
    peer: PeerId | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``message`` to the peer at ``origin``, and nobody else."""

    origin: Origin
    message: Message


@dataclass(frozen=True, slots=True)
class SendLatest:
    """Send the latest version to the peer at ``origin``; ``otherwise`` if there is none."""

    origin: Origin
    otherwise: Message


@dataclass(frozen=True, slots=True)
class FanOut:
    """Send ``message`` down hub ``hub``'s data path (a probe proving a subscription)."""

    hub: int
    message: Message


@dataclass(frozen=True, slots=True)
class Admit:
    """The peer at ``origin`` is a worker's now (its Welcome follows): the hub may keep
    what it keeps per peer (fan-outs reach it) until told to :class:`Forget` it."""

    origin: Origin


@dataclass(frozen=True, slots=True)
class Forget:
    """The peer at ``origin`` is no longer anyone's: drop what the hub keeps for it."""

    origin: Origin


Effect: TypeAlias = Reply | SendLatest | FanOut | Admit | Forget


@dataclass
class Session:
    """One worker's connection as the sender knows it (a row of ``status()``)."""

    worker: int
    origin: Origin
    transport: str
    secret: str
    attempt: str
    first_seen: float
    last_seen: float
    pid: int = 0
    host: str = ""
    version: int = 0
    epoch: int = 0
    last_ack: float | None = None
    last_latency: float | None = None
    received_bytes: int = 0
    rejected_frames: int = 0
    rejections: deque[str] = field(default_factory=lambda: deque(maxlen=REASONS_KEPT))
    last_repair: float = 0.0
    last_probe: float = float("-inf")
    #: The newest version a targeted send meant for this worker.
    target_version: int = 0
    #: (epoch, version) it last rejected: sending it again would only be rejected again.
    refused: tuple[int, int] = (0, 0)
    #: The latest version when it said hello: it gets (at least) that one.
    joining_to: int = 0
    #: When it said goodbye (None: it has not).
    left: float | None = None
    #: Its model is torn (it said so in its last request): a repair is what it waits for.
    torn: bool = False
    #: The latest version when it last asked for a whole one (a delta it could not
    #: apply): it is answered at once, once per version.
    asked_whole: int = -1
    #: For a relay: the workers behind it and the version each holds (its heartbeats),
    #: where its claim stands (see Fleet._claim).
    below: dict[int, int] = field(default_factory=dict)
    #: For a rank of a sharded learner: the version whose parts the worker gathers and
    #: the parts (ranks) of it it still waits for, as its last heartbeat said.
    waiting: tuple[int, tuple[int, ...]] = (0, ())
    #: Whether it may claim workers below it: its hub authenticated nobody, or
    #: authenticated it as a relay.
    may_relay: bool = True
    #: From its Reading notes: the chunk it last said it read (version, index), the
    #: longest seconds between two of its chunks of late (0.0: it reads fast), and when
    #: the last note came (its heartbeats say it lives, not that it reads).
    read: tuple[int, int] = (0, -1)
    read_gap: float = 0.0
    read_at: float = 0.0
    #: Whether its word that it reads once held a chunk to STALL_MAX, or held one while
    #: it was quiet once more after it was forgiven: not believed again.
    read_doubted: bool = False
    #: The chunk the window gave up on once it was quiet past two of its gaps, if so:
    #: its word counts again for later versions' chunks (its pace may have changed);
    #: and whether that was forgiven already (once in its session).
    read_quiet: tuple[int, int] | None = None
    read_forgiven: bool = False


@dataclass
class Send:
    """One version on its way, and who has answered."""

    version: int
    targets: frozenset[int]
    started: float
    deadline: float
    #: Targets chosen as "every live worker": one that says goodbye meanwhile is dropped.
    dynamic: bool = False
    acked: set[int] = field(default_factory=set)
    rejected: dict[int, str] = field(default_factory=dict)
    #: Targets reached through relays: relay id -> the workers behind it it is for.
    routes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.targets <= (self.acked | self.rejected.keys())

    @property
    def missing(self) -> set[int]:
        return set(self.targets - self.acked - self.rejected.keys())


def parse_below(below: Mapping[str, Any]) -> dict[int, int]:
    """A relay's report of the workers behind it, cut to MAX_BELOW and checked as the
    decoder checks it (ids of ASCII digits, ids and versions within the wire's range):
    what came some other way than the decoder is not trusted either."""
    out: dict[int, int] = {}
    for key, version in itertools.islice(below.items(), MAX_BELOW):
        worker = worker_id_key(key)
        if worker is not None and type(version) is int and 0 <= version <= U64_MAX:
            out[worker] = version
    return out
