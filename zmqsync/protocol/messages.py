"""The messages of the zmqsync wire protocol, as frozen dataclasses.

No I/O, no torch: these are plain values. :mod:`zmqsync.protocol.codec` turns them into
lists of buffers and back. Most messages lead with the header's fields (model_id,
version, epoch); the few that predate that order keep theirs (callers pass fields by
position).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

__all__ = [
    "AUTO_WORKER",
    "Ack",
    "Box",
    "Buffer",
    "Chunk",
    "ErrorMessage",
    "Goodbye",
    "Hello",
    "Kind",
    "Message",
    "Probe",
    "ProbeRequest",
    "Reading",
    "Slice",
    "SnapshotRequest",
    "StatusReply",
    "StatusRequest",
    "TensorEntry",
    "UpToDate",
    "Weights",
    "WeightsSchema",
    "Welcome",
]

Buffer: TypeAlias = bytes | bytearray | memoryview

#: A Hello from a worker that has no id yet: the sender assigns one in its Welcome.
AUTO_WORKER: Final = (1 << 64) - 1


class Kind(enum.IntEnum):
    """What a message is. The value is its byte in the header.

    ``WEIGHTS``: one :class:`Chunk` of a version (a version is a stream of them).
    """

    WEIGHTS = 1
    ACK = 2
    HELLO = 3
    WELCOME = 4
    SNAPSHOT_REQUEST = 5
    UP_TO_DATE = 6
    PROBE_REQUEST = 7
    PROBE = 8
    STATUS_REQUEST = 9
    STATUS_REPLY = 10
    ERROR = 11
    GOODBYE = 12
    READING = 13


@dataclass(frozen=True, slots=True)
class Box:
    """Where an entry's tensor lies in a larger one (a shard of a sharded learner's
    tensor): the larger tensor's ``shape``, and the index at which the entry starts in
    each dimension (the entry's own shape is its extent)."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Slice:
    """The box of one global tensor that a worker holds (a tensor-parallel worker's
    slice): the tensor's ``key``, its global ``shape``, where the slice starts in each
    dimension (``offsets``) and its ``extent`` (the shape of the worker's tensor). A
    sharded learner's ranks send that worker only the bytes of their parts inside it."""

    key: tuple[str, ...]
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    extent: tuple[int, ...]

    @property
    def dotted_key(self) -> str:
        return ".".join(self.key)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes are: ``buffers[buffer][offset : offset + nbytes]``.

    ``wire``: the dtype its bytes travel in, when the sender cast it (``wire_dtype``);
    ``nbytes`` counts those. ``dtype`` is always the tensor's own.
    ``box``: in a part of a version (see :class:`WeightsSchema`), the global tensor this
    entry is a box of; None: the entry is the whole tensor.
    """

    key: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    buffer: int
    offset: int
    nbytes: int
    wire: str = ""
    box: Box | None = None

    @property
    def dotted_key(self) -> str:
        return ".".join(self.key)


@dataclass(frozen=True, slots=True)
class WeightsSchema:
    """The layout of a weights message: strategy and one entry per tensor.

    A sharded learner's version is the union of ``parts`` parts, one per rank: this
    schema lays out part ``part`` (its entries may be boxes of the global tensors). A
    plain version is part 0 of 1.
    """

    strategy: str
    entries: tuple[TensorEntry, ...]
    part: int = 0
    parts: int = 1


@dataclass(frozen=True, slots=True)
class _Header:
    """The fields the header carries: whose model, and the version and epoch that the
    message is about (or that its sender holds)."""

    model_id: str
    version: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Weights(_Header):
    """A whole version: header fields, schema and raw buffers.

    Not a wire message: a version travels as :class:`Chunk` messages, and a receiver
    that gathered them all (or a test) holds them as one of these. Entries locate
    their bytes in ``buffers`` by index and offset; ``buffers`` are never copied.
    """

    schema: WeightsSchema
    buffers: tuple[Buffer, ...] = field(repr=False)


@dataclass(frozen=True, slots=True)
class Chunk(_Header):
    """Bytes ``[offset, offset + len(payload))`` of one version's byte stream.

    A version is the concatenation of its tensors' bytes as its schema lays them out
    (every entry in buffer 0, at its offset in the stream), cut into ``count`` chunks
    sent in order. Chunk 0 carries the schema; every chunk carries ``layout`` (the
    schema's digest), so no chunk can be applied under another version's layout.
    ``checksum``: the payload's CRC-32 plus one, or 0 when the sender computed none.
    ``metadata``: what the learner attached to the version (first chunk only; JSON).

    ``base``: the version is a *delta* against version ``base`` of the same epoch: its
    ``count`` chunks carry only the stretches of the stream that changed since then, in
    order, each at its ``offset``; every other byte is the same in ``base`` and in every
    version up to this one, so a worker holding any of them (whole) may apply it, and
    nobody else. ``None``: the whole stream.
    """

    index: int
    count: int
    offset: int
    total: int
    layout: bytes
    payload: Buffer = field(repr=False)
    schema: WeightsSchema | None = None
    checksum: int = 0
    metadata: dict[str, Any] | None = None
    base: int | None = None
    #: (first chunk only) the workers the version is for, when it was sent to some
    #: (``worker_ids``): a relay forwards it to those behind it only. None: to all.
    targets: tuple[int, ...] | None = None

    kind = Kind.WEIGHTS

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


@dataclass(frozen=True, slots=True)
class Ack(_Header):
    """A worker's report on a version: ``applied`` (it now holds ``version``) or not.

    ``version``/``epoch`` are what the worker holds after handling the message; a
    rejected ack carries the version it refused and ``reason``. ``session`` is the
    secret of the worker's Welcome: an ack without its worker's secret counts for nothing.
    """

    worker: int
    applied: bool
    reason: str = ""
    received_bytes: int = 0
    apply_seconds: float = 0.0
    rejected_frames: int = 0
    pid: int = 0
    host: str = ""
    session: str = ""

    kind = Kind.ACK


@dataclass(frozen=True, slots=True)
class Hello(_Header):
    """A worker introduces itself; ``version``/``epoch`` are what it already holds.

    ``attempt`` names one attempt to connect: a worker repeats its Hello until welcomed,
    and a repeat that arrives late (after the worker went on to newer versions) must not
    be taken for a worker starting over.
    """

    worker: int
    pid: int = 0
    host: str = ""
    attempt: str = ""
    #: The slices the worker holds (a tensor-parallel worker), at most
    #: :data:`~zmqsync.protocol.limits.MAX_SLICES`, one per tensor: each rank sends it
    #: only the bytes of its part inside them. Empty (left out of the bytes): the whole
    #: of every tensor.
    slices: tuple[Slice, ...] = ()

    kind = Kind.HELLO


@dataclass(frozen=True, slots=True)
class Welcome(_Header):
    """The sender's answer to :class:`Hello`: where to listen and where to ack.

    ``session`` is a secret for this worker alone (the Welcome travels to it over its
    own connection): every ack, request and goodbye it sends carries it, so nobody else
    can speak for it. ``attempt`` echoes the Hello's, so a late Welcome of an earlier
    attempt is not mistaken for the current one.
    """

    mode: str
    strategy: str
    data_endpoint: str = ""
    ack_endpoint: str = ""
    heartbeat_seconds: float = 1.0
    worker: int = 0  # the id of the worker welcomed (assigned, if it asked for one)
    session: str = ""
    attempt: str = ""
    #: A sharded learner's ranks, each sending its part of every version: their
    #: endpoints, rank 0's first (empty: one sender sends whole versions).
    ranks: tuple[str, ...] = ()

    kind = Kind.WELCOME


@dataclass(frozen=True, slots=True)
class SnapshotRequest(_Header):
    """A worker asks for the latest version; it holds ``version`` of ``epoch``."""

    worker: int
    session: str = ""
    #: The worker's model is torn (an in-place stream broke): it holds no whole version.
    torn: bool = False
    #: A delta of the latest version came that it cannot apply (it holds an older
    #: version than the delta's base, or not the bytes to patch): it needs the whole one.
    whole: bool = False
    #: From a relay: the workers behind it, ``{"<worker id>": version held}`` (at most
    #: :data:`~zmqsync.protocol.limits.MAX_BELOW`), so that its sender can say who a
    #: late ack waits for. Checked as strictly as the header: ids of ASCII digits within
    #: the wire's integer range, versions too.
    below: dict[str, int] = field(default_factory=dict)
    #: To a rank of a sharded learner: the version whose parts the worker is gathering
    #: (0: none) and the parts of it it still waits for (ascending, each below
    #: :data:`~zmqsync.protocol.limits.MAX_PARTS`), so that a rank whose send waits can
    #: say which ranks the workers wait for. Left out of the bytes when empty.
    gathering: int = 0
    waiting: tuple[int, ...] = ()

    kind = Kind.SNAPSHOT_REQUEST


@dataclass(frozen=True, slots=True)
class UpToDate(_Header):
    """The sender's answer to a snapshot request when it sends nothing now.

    ``in_flight``: the latest version is already on its way to this worker (sent less
    than the repair interval ago): keep waiting for it rather than count as caught up.
    """

    in_flight: bool = False

    kind = Kind.UP_TO_DATE


@dataclass(frozen=True, slots=True)
class _Probing:
    """The fields of a probe and of its request: the worker, and the nonce it chose."""

    model_id: str
    worker: int
    nonce: str
    version: int = 0
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class ProbeRequest(_Probing):
    """A worker asks the sender to echo ``nonce`` down the data path (fan-out handshake)."""

    session: str = ""

    kind = Kind.PROBE_REQUEST


@dataclass(frozen=True, slots=True)
class Probe(_Probing):
    """Sent down the data path: proves to ``worker`` that its subscription is live."""

    kind = Kind.PROBE


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """Anyone (the CLI) asks a sender for its sync state."""

    model_id: str = ""
    version: int = 0
    epoch: int = 0

    kind = Kind.STATUS_REQUEST


@dataclass(frozen=True, slots=True)
class StatusReply(_Header):
    """A sender's sync state: a JSON object (see :meth:`WeightSender.status`)."""

    status: dict[str, Any] = field(default_factory=dict)

    kind = Kind.STATUS_REPLY


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """The sender's answer to a request it could not serve (malformed, wrong model)."""

    model_id: str
    #: What went wrong, for the worker to act on: ``"wrong-model"``, ``"malformed"``,
    #: ``"unknown-session"`` and ``"duplicate-worker"`` (say hello again), ...
    code: str
    #: Why, for a person to read.
    message: str
    version: int = 0
    epoch: int = 0

    kind = Kind.ERROR


@dataclass(frozen=True, slots=True)
class Goodbye(_Header):
    """A worker leaves (its receiver closed): it will not ack again until it says hello.

    ``version``/``epoch``: what it held when it left; ``session``: its Welcome's secret.
    A sender stops waiting for it at once: a fleet of known size fails a send that
    targets it, naming it; a fleet that is whoever connected (``num_workers=None``)
    simply no longer counts it.
    """

    worker: int
    session: str = ""

    kind = Kind.GOODBYE


@dataclass(frozen=True, slots=True)
class Reading(_Header):
    """A worker that reads a version's chunks slowly says so, as it reads them (never
    answered): it read chunk ``index`` of ``version`` of ``epoch``, and ``gap`` is the
    longest time (seconds) between two of its chunks in its last two versions.

    Its sender's window then tells a slow link from a stopped worker: a chunk held past
    the stall limit is waited for while a worker it went to, and has not yet read, keeps
    saying it reads (see :mod:`zmqsync.sender.pump`). A worker whose chunks come faster
    than :data:`~zmqsync.receiver.pace.NOTE_GAP` apart says nothing, but once to say its
    pace is back.
    """

    worker: int
    session: str
    index: int
    gap: float

    kind = Kind.READING


Message: TypeAlias = (
    Chunk
    | Ack
    | Hello
    | Welcome
    | SnapshotRequest
    | UpToDate
    | ProbeRequest
    | Probe
    | StatusRequest
    | StatusReply
    | ErrorMessage
    | Goodbye
    | Reading
)
