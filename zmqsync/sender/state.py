"""What a sender holds, declared once for the parts of :class:`~zmqsync.sender.WeightSender`
(its ``__init__`` sets it all): each part reads and changes this state under the locks
named here."""

from __future__ import annotations

import abc
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zmqsync.chunking.delta import DeltaTracker
from zmqsync.chunking.layout import StreamLayout
from zmqsync.fleet import Fleet
from zmqsync.tensors.flatten import Flattener
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.tensors.shared_params import SharedParams
from zmqsync.vocabulary import Metadata

if TYPE_CHECKING:
    from zmqsync.sender.pump import HubRunner
    from zmqsync.sender.transfers import Copy, Forwarding, Pending, Ring

__all__ = ["SenderState"]


class SenderState:
    """The sender's state and settings (see :class:`~zmqsync.sender.WeightSender`)."""

    # --- settings ------------------------------------------------------------------
    model_id: str
    model: Any
    strategy: str
    timeout: float
    share_params: bool
    retain_snapshot: bool
    heartbeat: float
    repair_after: float
    mode: str
    epoch: int
    chunk_bytes: int
    checksums: bool
    wire_dtype: torch.dtype | None
    delta: bool

    # --- the fleet and the hubs: ``_cond`` guards the fleet, the pending send and the
    # forwarded version; each runner's baton guards its hub ---------------------------
    fleet: Fleet
    _cond: threading.Condition
    _send_lock: threading.Lock
    _runners: list[HubRunner]
    _closed: bool
    _pump_error: BaseException | None
    _pending: Pending | None
    _forwarding: Forwarding | None
    _async_pending: bool

    # --- copies: ``_snapshot_lock`` guards the snapshot --------------------------------
    _flattener: Flattener
    _model_tensors: ModelTensors
    _layout: StreamLayout | None
    _ring: Ring
    _snapshot: Copy | None
    _snapshot_lock: threading.Lock
    _tracker: DeltaTracker | None
    _shared: SharedParams | None
    _share_problem: str | None
    _metadata: Metadata | None

    # --- what it says of itself --------------------------------------------------------
    _totals: dict[str, int]
    _last_delta: dict[str, Any] | None
    _started: float
    _last_expiry: float
    _last_error_log: float
    _latencies: deque[float]
    _latency_counts: list[int]
    _latency_sum: float
    #: How long chunks usually take to be let go of (seconds, a moving average), and
    #: when a chunk last stalled.
    _release_time: float
    _last_stall: float

    # --- what one part asks of another -----------------------------------------------
    num_workers: int | None

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The latest version (WeightSender's)."""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where workers connect (WeightSender's)."""

    _latest: Callable[[], Copy | None]
    _share: Callable[[dict[Any, Any]], SharedParams | None]
    _handle: Callable[..., None]
    _answer_askers: Callable[..., bool]
    status: Callable[[], dict[str, Any]]
