"""A running sender's sync state, asked over its main endpoint, and judged.

:func:`query_status` gets what ``WeightSender.status()`` returns in the learner's own
process, from any other process (``zmqsync status``); :func:`assess` says which workers
are behind, missing or silent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import zmq

from zmqsync.endpoints import check_connectable
from zmqsync.errors import FrameError, SyncTimeout, TransportError
from zmqsync.protocol import ErrorMessage, StatusReply, StatusRequest, decode, encode
from zmqsync.security import CurveClient
from zmqsync.status_types import SenderStatus, WorkerStatus
from zmqsync.transport._zmq import translated

__all__ = [
    "DEFAULT_SILENT_AFTER",
    "DEFAULT_STATUS_TIMEOUT",
    "assess",
    "query_status",
    "worker_problem",
]

#: Seconds :func:`query_status` waits for a sender's answer. A sender answers from its
#: pump thread at once; seconds of silence mean nobody is there.
DEFAULT_STATUS_TIMEOUT: Final = 3.0
#: A worker the sender has not heard from for this long is reported as silent. Workers
#: send a heartbeat every second by default, so ten missed ones are not a hiccup.
DEFAULT_SILENT_AFTER: Final = 10.0
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
    check_connectable(endpoint)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds; got {timeout}")
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        with translated(f"asking {endpoint} for its status"):
            if curve is not None:
                curve.apply(sock)  # before connect(), or it does not take
            sock.sndtimeo = int(timeout * 1000)
            sock.connect(endpoint)
            try:
                sock.send_multipart(encode(StatusRequest()))
            except zmq.Again as exc:  # the request could not even be queued
                raise SyncTimeout(f"could not reach {endpoint} within {timeout:g}s") from exc
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise SyncTimeout(
                    f"no zmqsync sender answered at {endpoint} within {timeout:g}s: is the "
                    "learner running, and is this the endpoint it printed?"
                )
            frames = sock.recv_multipart(zmq.NOBLOCK)  # poll said it is there
    finally:
        sock.close(linger=0)
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
