"""A running sender's sync state, asked over its main endpoint, and judged.

:func:`query_status` gets what ``WeightSender.status()`` returns in the learner's own
process, from any other process (``zmqsync status``); :func:`assess` says which workers
are behind, missing or silent; :func:`query_ranks` asks every rank of a sharded
learner, named in one rank's status, for its row.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import zmq

from zmqsync.endpoints import check_connectable
from zmqsync.errors import FrameError, SyncTimeout, TransportError, ZMQSyncError
from zmqsync.protocol import ErrorMessage, StatusReply, StatusRequest, decode, encode
from zmqsync.protocol.limits import MAX_BODY_BYTES
from zmqsync.security import CurveClient
from zmqsync.status_types import SenderStatus, WorkerStatus
from zmqsync.transport._zmq import translated

__all__ = [
    "DEFAULT_SILENT_AFTER",
    "DEFAULT_STATUS_TIMEOUT",
    "STATUS_RANKS",
    "RankRow",
    "assess",
    "query_ranks",
    "query_status",
    "rank_problems",
    "worker_problem",
]

#: Seconds :func:`query_status` waits for a sender's answer. A sender answers from its
#: pump thread at once; seconds of silence mean nobody is there.
DEFAULT_STATUS_TIMEOUT: Final = 3.0
#: A worker the sender has not heard from for this long is reported as silent. Workers
#: send a heartbeat every second by default, so ten missed ones are not a hiccup.
DEFAULT_SILENT_AFTER: Final = 10.0
#: The ranks of a sharded learner that :func:`query_ranks` asks at once (more than any
#: learner's ranks on one status page); the rest are listed, not asked. Each answer is
#: at most a status body, so what one look costs stays bounded whatever a rank claims.
STATUS_RANKS: Final = 256
#: A worker's refusal reason quoted in :func:`worker_problem` (reasons can be long).
MAX_REASON_CHARS: Final = 200


def query_status(
    endpoint: str,
    timeout: float = DEFAULT_STATUS_TIMEOUT,
    *,
    curve: CurveClient | None = None,
    context: zmq.Context[Any] | None = None,
) -> dict[str, Any]:
    """Ask the sender bound at ``endpoint`` for its sync state.

    Returns the dict of :meth:`zmqsync.WeightSender.status` (model_id, version, epoch,
    uptime, per-worker state, totals) as the sender sent it; ``SenderStatus.from_dict``
    checks it and reads it as attributes. Raises :class:`EndpointError` for an address
    that cannot be connected to, :class:`SyncTimeout` when nothing answers within
    ``timeout`` seconds, and :class:`TransportError` when something answers that is not
    a zmqsync sender. The socket is closed with ``linger=0``: a dead sender never blocks
    the exit. A sender with CURVE keys answers only a client with ``curve`` keys it
    accepts.

    Example::

        state = query_status("tcp://127.0.0.1:5555")
        behind = assess(state)        # {} when every worker holds the latest version
    """
    (answer,) = _ask_each([endpoint], timeout, curve, context)
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _ask_each(
    endpoints: Sequence[str],
    timeout: float,
    curve: CurveClient | None,
    context: zmq.Context[Any] | None,
) -> list[dict[str, Any] | ZMQSyncError]:
    """Ask every one of ``endpoints`` at once, all within one ``timeout``: each one's
    status, or the error that says why there is none (one silent sender costs the
    others nothing, and the whole takes at most ``timeout`` seconds)."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds; got {timeout}")
    ctx = context or zmq.Context.instance()
    answers: list[dict[str, Any] | ZMQSyncError] = []
    asked: dict[zmq.Socket[Any], int] = {}
    try:
        for i, endpoint in enumerate(endpoints):
            try:
                asked[_asking(ctx, endpoint, timeout, curve)] = i
                answers.append(_silent(endpoint, timeout, curve))
            except ZMQSyncError as exc:
                answers.append(exc)
        _collect(asked, answers, endpoints, timeout)
    finally:
        for sock in asked:
            sock.close(linger=0)
    return answers


def _asking(
    ctx: zmq.Context[Any], endpoint: str, timeout: float, curve: CurveClient | None
) -> zmq.Socket[Any]:
    """A socket connected to ``endpoint`` with a status request on its way. Its replies
    are bounded (a body's limit each, two at most queued): whoever answers, the client
    holds little."""
    check_connectable(endpoint)
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        with translated(f"asking {endpoint} for its status"):
            if curve is not None:
                curve.apply(sock)  # before connect(), or it does not take
            sock.maxmsgsize = MAX_BODY_BYTES
            sock.rcvhwm = 2
            sock.sndtimeo = int(timeout * 1000)
            sock.connect(endpoint)
            try:
                sock.send_multipart(encode(StatusRequest()))
            except zmq.Again as exc:  # the request could not even be queued
                raise SyncTimeout(
                    f"could not reach {endpoint} within {timeout:g}s: {_hint(curve)}"
                ) from exc
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _collect(
    asked: dict[zmq.Socket[Any], int],
    answers: list[dict[str, Any] | ZMQSyncError],
    endpoints: Sequence[str],
    timeout: float,
) -> None:
    """Read each asked socket's reply into ``answers`` as it comes, until all have
    answered or ``timeout`` is over (the ones still silent keep their timeout error)."""
    poller = zmq.Poller()
    for sock in asked:
        poller.register(sock, zmq.POLLIN)
    waiting = set(asked)
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for sock, _ in poller.poll(max(1, int(left * 1000))):
            if sock not in waiting:
                continue
            waiting.discard(sock)
            poller.unregister(sock)
            i = asked[sock]
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)  # poll said it is there
                answers[i] = _reply(endpoints[i], frames)
            except zmq.ZMQError as exc:
                answers[i] = TransportError(f"asking {endpoints[i]} for its status: {exc}")
            except ZMQSyncError as exc:
                answers[i] = exc


def _silent(endpoint: str, timeout: float, curve: CurveClient | None) -> SyncTimeout:
    """The error of a sender that has not answered (yet)."""
    return SyncTimeout(
        f"no zmqsync sender answered at {endpoint} within {timeout:g}s: {_hint(curve)}"
    )


def _hint(curve: CurveClient | None) -> str:
    """What to check when nothing answered: a learner with CURVE keys refuses, silently,
    a client without keys it accepts."""
    if curve is None:
        return (
            "is the learner running, and is this the endpoint it printed? (a learner "
            "with CURVE keys answers only clients given keys it accepts)"
        )
    return (
        "is the learner running, is this the endpoint it printed, and does it accept "
        "these keys (its server key, a client key in its clients folder)?"
    )


def _reply(endpoint: str, frames: list[bytes]) -> dict[str, Any]:
    """The status in a reply from ``endpoint``, or the error that says what it was."""
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


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank of a sharded learner, as ``zmqsync status`` shows it: where it is bound,
    whether it answered, and if so the version it sent last and the bytes it sent
    (``problem``: what is wrong with it, in words; None if nothing)."""

    rank: int
    endpoint: str
    answered: bool
    version: int = 0
    epoch: int = 0
    bytes_sent: int = 0
    host: str = ""
    pid: int = 0
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON row (``zmqsync status --json``'s ``ranks``)."""
        return dataclasses.asdict(self)


def query_ranks(
    status: SenderStatus | Mapping[str, Any],
    timeout: float = DEFAULT_STATUS_TIMEOUT,
    *,
    curve: CurveClient | None = None,
    context: zmq.Context[Any] | None = None,
) -> list[RankRow]:
    """A row per rank of the sharded learner whose rank's ``status`` this is (what
    :func:`query_status` returned from any rank, rank 0's usually): the others are
    asked at once, with the same ``curve`` keys, all within ``timeout`` seconds. A rank
    that does not answer in time (or answers as another rank, or of another learner)
    has a row that says so. At most :data:`STATUS_RANKS` ranks are asked; the rest are
    listed unasked. Empty for an unsharded sender's status."""
    if not isinstance(status, SenderStatus):
        status = SenderStatus.from_dict(status)
    if status.rank is None or not status.ranks:
        return []
    endpoints = status.ranks
    others = [r for r in range(min(len(endpoints), STATUS_RANKS)) if r != status.rank]
    answers = dict(
        zip(others, _ask_each([endpoints[r] for r in others], timeout, curve, context), strict=True)
    )
    rows = []
    for r, endpoint in enumerate(endpoints):
        if r == status.rank:
            rows.append(_row(r, endpoint, status))
        elif r not in answers:
            rows.append(RankRow(r, endpoint, False, problem=f"rank {r} was not asked"))
        else:
            rows.append(_answered(r, endpoint, answers[r], status))
    return _judged(rows)


def _answered(
    r: int, endpoint: str, answer: dict[str, Any] | ZMQSyncError, asked: SenderStatus
) -> RankRow:
    """Rank ``r``'s row from its answer (its status, or why there is none), checked
    against the rank first asked: the same learner, the same epoch, and rank ``r``."""
    if isinstance(answer, ZMQSyncError):
        return RankRow(r, endpoint, False, problem=f"rank {r} is not answering: {answer}")
    try:
        state = SenderStatus.from_dict(answer)
    except FrameError as exc:
        return RankRow(r, endpoint, False, problem=f"rank {r} answered nonsense: {exc}")
    row = _row(r, endpoint, state)
    if state.rank != r or state.model_id != asked.model_id:
        said = "an unsharded sender" if state.rank is None else f"rank {state.rank}"
        problem = f"rank {r} answered as {said} of model {state.model_id!r}"
        return dataclasses.replace(row, problem=problem[:MAX_REASON_CHARS])
    if state.epoch != asked.epoch:
        return dataclasses.replace(
            row,
            problem=f"rank {r} is of another epoch ({state.epoch:x}, not {asked.epoch:x}): "
            "is it a rank of a restarted learner, or of the one before?",
        )
    return row


def _row(r: int, endpoint: str, state: SenderStatus) -> RankRow:
    """The row of rank ``r`` from its own status."""
    return RankRow(
        r,
        endpoint,
        True,
        version=state.version,
        epoch=state.epoch,
        bytes_sent=state.totals.bytes_sent,
        host=state.host,
        pid=state.pid,
    )


def _judged(rows: list[RankRow]) -> list[RankRow]:
    """``rows``, each rank that answered behind the newest version said to be behind
    (every rank sends every version: one behind missed a send)."""
    newest = max((row.version for row in rows if row.answered), default=0)
    return [
        dataclasses.replace(row, problem=f"rank {row.rank} sent version {row.version} of {newest}")
        if row.problem is None and row.answered and row.version < newest
        else row
        for row in rows
    ]


def rank_problems(rows: Sequence[RankRow]) -> dict[int, str]:
    """``{rank: problem}`` for every rank row with one (empty: every rank answered, of
    the same learner and epoch, at the newest version)."""
    return {row.rank: row.problem for row in rows if row.problem is not None}


def worker_problem(
    worker: WorkerStatus | Mapping[str, Any],
    version: int,
    silent_after: float | None = DEFAULT_SILENT_AFTER,
) -> str | None:
    """What is wrong with one worker of a status (a row, or its dict), in words;
    ``None`` if nothing."""
    if not isinstance(worker, WorkerStatus):
        worker = WorkerStatus.from_dict(worker)
    worker_id = worker.worker
    if not worker.connected:
        return f"worker {worker_id} has not connected"
    if worker.left:
        # Gone on purpose: a problem only where the fleet has a fixed size that counts it.
        if not worker.expected:
            return None
        ago = worker.since_left_s
        when = "" if ago is None else f" {ago:.0f}s ago"
        return (
            f"worker {worker_id} left{when} (its receiver closed; sends to it fail until it "
            "is back)"
        )
    held = worker.version
    if worker.torn:
        doing = "being repaired" if worker.repairing else "waiting for a repair"
        return (
            f"worker {worker_id} is torn (a version's stream broke while it was written in place; "
            f"forward passes wait): {doing}, last whole version {held}"
        )
    if held < version:
        problem = f"worker {worker_id} holds version {held} of {version} ({version - held} behind)"
        if worker.rejections:  # why it is behind, when it said so
            problem += f"; it refused: {worker.rejections[-1][:MAX_REASON_CHARS]}"
        return problem
    seen = worker.since_last_seen_s
    if silent_after is not None and seen is not None and seen > silent_after:
        return f"worker {worker_id} has been silent for {seen:.0f}s (is it still running?)"
    return None


def assess(
    status: SenderStatus | Mapping[str, Any], *, silent_after: float | None = DEFAULT_SILENT_AFTER
) -> dict[int, str]:
    """``{worker: problem}`` for every worker that is behind, missing or silent.

    ``status``: a :class:`~zmqsync.SenderStatus`, or its dict (``status()``, or what
    :func:`query_status` returned; :class:`~zmqsync.FrameError` if it is malformed).
    Empty when every worker holds the sender's current version: that is what
    ``zmqsync status`` exits 0 on. ``silent_after=None`` ignores silence.
    """
    if not isinstance(status, SenderStatus):
        status = SenderStatus.from_dict(status)
    problems = {}
    for worker in status.workers:
        problem = worker_problem(worker, status.version, silent_after)
        if problem is not None:
            problems[worker.worker] = problem
    return problems
