"""A sender's sync state as typed records: what ``WeightSender.report()`` returns.

``as_dict()`` gives the JSON object that ``status()`` returns and a status reply
carries; ``from_dict()`` reads one back from another process, trusting nothing:
unknown keys are ignored, missing ones take their defaults, and a value of the wrong
type or a list longer than a sender sends raises :class:`~zmqsync.errors.FrameError`.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, TypeVar, Union, get_args, get_origin, get_type_hints

from zmqsync.errors import FrameError
from zmqsync.protocol import MAX_BELOW, MAX_PARTS

__all__ = [
    "MAX_ITEMS",
    "STATUS_BELOW",
    "STATUS_ROWS",
    "UNCONNECTED_KEYS",
    "LatencyHistogram",
    "RelayCounts",
    "SenderStatus",
    "Totals",
    "UpstreamStatus",
    "WorkerStatus",
]

#: Worker rows in a status; the rest are counted, so a reply stays far below the
#: protocol's body limit at any fleet size.
STATUS_ROWS: Final = 1_000
#: Workers behind one relay that its status row names (the furthest behind first):
#: whatever relays claim, a status reply stays small and cheap to build.
STATUS_BELOW: Final = 32
#: The longest other list or dict ``from_dict`` takes (reasons, histogram buckets,
#: counters): a sender sends far fewer.
MAX_ITEMS: Final = 1_000
#: All that a worker expected but never connected has in its JSON row.
UNCONNECTED_KEYS: Final = ("worker", "connected", "live", "left", "expected", "version", "lag")

# Options a field may carry in its metadata.
_MAX = "max"  # the longest list or dict it takes (MAX_ITEMS if unsaid; None: any)
_REST = "rest"  # the keys without a field of their own: flattened into the JSON, last
_OMIT_NONE = "omit_none"  # left out of the JSON when None

_R = TypeVar("_R", bound="_Record")


class _Record:
    """What every status record shares: its JSON object, and reading one back."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]

    @classmethod
    def from_dict(cls: type[_R], doc: Mapping[str, Any]) -> _R:
        """Read one from its JSON object (received from another process, say)."""
        return _read_record(cls, doc, "")

    def as_dict(self) -> dict[str, Any]:
        """The JSON-ready dict, key for key what ``status()`` has."""
        out: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get(_REST):
                rest = dict(value)
            elif value is not None or not f.metadata.get(_OMIT_NONE):
                out[f.name] = _plain(value)
        return {**out, **rest}


@dataclass(frozen=True, slots=True)
class WorkerStatus(_Record):
    """One worker as its sender knows it: a row of ``status()["workers"]``.

    A worker expected but never connected keeps the defaults, and its JSON row has
    only ``UNCONNECTED_KEYS``. ``below``: for a relay, the version each worker behind
    it holds, by worker id (as its heartbeats say; at most ``STATUS_BELOW`` of them, the
    furthest behind first); ``below_total``: how many workers its claim stands for.
    """

    worker: int
    connected: bool = False
    live: bool = False
    left: bool = False
    since_left_s: float | None = None
    expected: bool = False
    transport: str = ""
    host: str = ""
    pid: int = 0
    version: int = 0
    lag: int = 0
    since_last_ack_s: float | None = None
    since_last_seen_s: float | None = None
    last_latency_s: float | None = None
    received_bytes: int = 0
    rejected_frames: int = 0
    rejections: list[str] = field(default_factory=list)
    torn: bool = False
    repairing: bool = False
    below: dict[str, int] | None = field(default=None, metadata={_MAX: MAX_BELOW})
    below_total: int = 0
    #: Present (True) only while the worker is sent copies instead of shared memory (it
    #: keeps versions mapped and holds one it has not taken in: stopped, stuck), with
    #: ``shm_pinned``, the shared-memory blocks it holds meanwhile.
    shm_copies: bool | None = field(default=None, metadata={_OMIT_NONE: True})
    shm_pinned: int | None = field(default=None, metadata={_OMIT_NONE: True})

    def __post_init__(self) -> None:
        if self.below and not all(w.isascii() and w.isdigit() for w in self.below):
            raise ValueError("the workers behind a relay are named by their ids")

    def as_dict(self) -> dict[str, Any]:
        row = _Record.as_dict(self)
        return row if self.connected else {k: row[k] for k in UNCONNECTED_KEYS}


@dataclass(frozen=True, slots=True)
class LatencyHistogram(_Record):
    """Sync latencies in buckets: ``counts[i]`` sends took at most ``le[i]`` seconds
    (and more than the bucket before); the last count, longer than every bucket."""

    le: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=lambda: [0])
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.le) + 1:
            raise ValueError(f"{len(self.le)} buckets need {len(self.le) + 1} counts")


@dataclass(frozen=True, slots=True)
class Totals(_Record):
    """A sender's counts since it started: ``status()["totals"]``.

    ``transport``: its transports' own counts (dropped sends, shared memory), each a
    key of its own in the JSON.
    """

    versions_sent: int = 0
    bytes_sent: int = 0
    chunks_sent: int = 0
    stalls: int = 0
    params_moved: int = 0
    repairs_sent: int = 0
    repair_bytes: int = 0
    repairs_skipped: int = 0
    timeouts: int = 0
    deltas_sent: int = 0
    #: Messages whose handling failed unexpectedly: logged and counted, the pump goes on.
    message_errors: int = 0
    #: Status requests answered only once the send under way was over, and those dropped
    #: because too many waited (a status request never delays a send).
    status_deferred: int = 0
    status_dropped: int = 0
    #: Workers that lent their tensors and did not say go in time for a version (it was
    #: streamed to them; they are not asked again until they acked it).
    lent_go_missed: int = 0
    rejected_frames: int = 0
    forged: int = 0
    refused_claims: int = 0
    expired: int = 0
    goodbyes: int = 0
    stray_goodbyes: int = 0
    probes_limited: int = 0
    latency_p50_s: float | None = None
    latency_p90_s: float | None = None
    latency_p99_s: float | None = None
    latency_histogram: LatencyHistogram | None = None
    rejections: list[str] = field(default_factory=list)
    transport: dict[str, int] = field(default_factory=dict, metadata={_REST: True})


@dataclass(frozen=True, slots=True)
class UpstreamStatus(_Record):
    """Where a relay stands with its upstream: ``status()["upstream"]``.

    ``receiver``: its receiver's counts (bytes received, versions applied), each a key
    of its own in the JSON.
    """

    worker: int | None = None
    version: int = 0
    epoch: int = 0
    ack_owed: bool = False
    receiver: dict[str, float] = field(default_factory=dict, metadata={_REST: True})


@dataclass(frozen=True, slots=True)
class RelayCounts(_Record):
    """What a relay forwarded: ``status()["relay"]``."""

    versions_forwarded: int = 0
    chunks_forwarded: int = 0
    aborted: int = 0
    refetches: int = 0


@dataclass(frozen=True, slots=True)
class SenderStatus(_Record):
    """A sender's sync state: what ``WeightSender.report()`` returns, and ``status()``
    as a dict (:meth:`as_dict`).

    At most ``STATUS_ROWS`` worker rows (the furthest behind); ``workers_total``
    counts them all. A sharded learner's rank says which it is (``rank``), every rank's
    endpoint (``ranks``) and the ranks a waiting send still lacks (``waiting_ranks``).
    ``totals`` (a ``Totals``), and a relay's ``upstream`` (an ``UpstreamStatus``)
    and ``relay`` (a ``RelayCounts``) are records of ``zmqsync.status_types`` too; a
    sender's JSON leaves the last two out.
    :meth:`from_dict` reads the JSON back, trusting nothing: unknown keys are
    ignored, missing ones take their defaults, and a value of the wrong type or a list
    longer than a sender sends raises :class:`~zmqsync.FrameError`.
    """

    model_id: str = ""
    version: int = 0
    epoch: int = 0
    mode: str = ""
    endpoint: str = ""
    strategy: str = ""
    num_workers: int | None = None
    metadata: dict[str, Any] | None = field(default=None, metadata={_MAX: None})
    wire_dtype: str | None = None
    delta: dict[str, Any] | None = field(default=None, metadata={_MAX: None})
    share_params: str | None = None
    uptime_s: float = 0.0
    host: str = ""
    pid: int = 0
    workers_total: int = 0
    workers_live: int = 0
    workers_shown: int = 0
    workers: list[WorkerStatus] = field(default_factory=list, metadata={_MAX: STATUS_ROWS})
    totals: Totals = field(default_factory=Totals)
    upstream: UpstreamStatus | None = field(default=None, metadata={_OMIT_NONE: True})
    relay: RelayCounts | None = field(default=None, metadata={_OMIT_NONE: True})
    #: A sharded learner's rank: which one this is, every rank's endpoint (rank 0's
    #: first), and while a send waits, the ranks whose parts workers still wait for
    #: (by rank, the workers waiting), as their heartbeats said. An unsharded sender's
    #: JSON leaves the three out.
    rank: int | None = field(default=None, metadata={_OMIT_NONE: True})
    ranks: list[str] | None = field(default=None, metadata={_OMIT_NONE: True, _MAX: MAX_PARTS})
    waiting_ranks: dict[str, list[int]] | None = field(
        default=None, metadata={_OMIT_NONE: True, _MAX: MAX_PARTS}
    )

    def __post_init__(self) -> None:
        count = len(self.ranks or ()) or None
        if self.rank is not None and not 0 <= self.rank < (count or self.rank + 1):
            raise ValueError(f"rank {self.rank} is not one of its {count} ranks")
        if self.waiting_ranks and not all(r.isascii() and r.isdigit() for r in self.waiting_ranks):
            raise ValueError("the ranks waited for are named by their numbers")


# --- to and from JSON ----------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` with every record in it turned into its dict, and containers copied."""
    if isinstance(value, _Record):
        return value.as_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


#: Each record's field types, resolved once.
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    return hints


def _read_record(cls: type[_R], doc: Any, where: str) -> _R:
    if not isinstance(doc, Mapping):
        raise _malformed(where, f"must be an object; got {_kind(doc)}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        bound = f.metadata.get(_MAX, MAX_ITEMS)
        if f.metadata.get(_REST):
            known = cls.__dataclass_fields__.keys()
            rest = {k: v for k, v in doc.items() if k not in known and _fits(hints[f.name], k, v)}
            values[f.name] = _read(hints[f.name], rest, where, bound)
        elif f.name in doc:
            inner = f"{where}.{f.name}" if where else f.name
            values[f.name] = _read(hints[f.name], doc[f.name], inner, bound)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _malformed(where, f"has no {f.name!r}")
    try:
        return cls(**values)
    except ValueError as exc:  # what its __post_init__ checks
        raise _malformed(where, f"is refused: {exc}") from None


def _fits(hint: Any, key: Any, value: Any) -> bool:
    """Whether ``key: value`` belongs in a rest field of type ``hint`` (a dict)."""
    try:
        _read(hint, {key: value}, "", None)
    except FrameError:
        return False
    return True


def _read(hint: Any, value: Any, where: str, bound: int | None) -> Any:
    """``value`` checked against the type ``hint`` (records read as such)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return _read(inner, value, where, bound)
    if isinstance(hint, type) and issubclass(hint, _Record):
        return _read_record(hint, value, where)
    if origin is list or origin is dict:
        if not isinstance(value, (list, tuple) if origin is list else Mapping):
            raise _malformed(where, f"must be {_json_name(origin)}; got {_kind(value)}")
        if bound is not None and len(value) > bound:
            raise _malformed(where, f"has {len(value)} items; at most {bound} are sent")
        if isinstance(value, (list, tuple)):
            return [_read(args[0], v, f"{where}[{i}]", MAX_ITEMS) for i, v in enumerate(value)]
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _malformed(where, f"has a key that is not a string: {_kind(k)}")
            out[k] = _read(args[1], v, f"{where}[{k!r}]", MAX_ITEMS)
        return out
    if hint is float:
        fits = type(value) in (int, float) and math.isfinite(value)
    else:  # bool, int, str: exactly that (JSON's true is no count)
        fits = type(value) is hint
    if not fits:
        raise _malformed(where, f"must be {_json_name(hint)}; got {_kind(value)}")
    return value


def _malformed(where: str, what: str) -> FrameError:
    """The error for a value at ``where`` (a path from the top: ``workers[0].version``)."""
    return FrameError(f"malformed status: {where or 'it'} {what}")


def _json_name(hint: Any) -> str:
    """What JSON calls the values of type ``hint``, for error messages."""
    names = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}
    return names.get(hint, "a list" if hint is list else "an object")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
