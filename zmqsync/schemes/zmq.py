"""ZMQWeightSyncScheme: weight sync over ZeroMQ, fan-out or addressed."""

from __future__ import annotations

from typing import Any, Final

from zmqsync.schemes.base import DEFAULT_CONNECT_TIMEOUT, WeightSyncScheme
from zmqsync.security import CurveClient, CurveServer
from zmqsync.tensors.model_tensors import ModelTensors
from zmqsync.vocabulary import Mode, Strategy, as_mode

__all__ = ["ZMQWeightSyncScheme"]

#: The transport alias that carries each mode.
_TRANSPORTS: Final[dict[Mode, str]] = {"pubsub": "zmq-pubsub", "router": "zmq-router"}


class ZMQWeightSyncScheme(WeightSyncScheme):
    """Weight synchronization over ZeroMQ sockets: processes, hosts, containers.

    Args:
        strategy: ``"tensordict"`` (default) or ``"state_dict"``.
        mode: ``"pubsub"``: one PUB fans each version out (best for many workers);
            ``"router"``: the sender addresses each worker over DEALER/ROUTER.
        endpoint: ``tcp://HOST:PORT``, ``ipc:///PATH`` or ``inproc://NAME`` that the sender
            binds (the ack and data sockets take the next ports / suffixed paths);
            ``None`` picks a free ipc path in a private temp dir.
        timeout: seconds ``send()`` waits for every targeted worker's ack.
        connect_timeout: seconds ``connect()`` waits by default: the sender for its
            ``num_workers`` workers, a worker for the sender and its latest version.
        curve_server: the sender's CURVE keys (:class:`~zmqsync.security.CurveServer`):
            every socket is encrypted, and only ``allowed_clients`` may connect.
        curve_client: a worker's CURVE keys (:class:`~zmqsync.security.CurveClient`).
        insecure: allow binding a non-loopback address without CURVE keys.
        shared_memory: whether workers that can open the learner's shared-memory blocks
            (same host and pid namespace) read each version there in place, instead of
            through the socket. ``None`` (default): over ``ipc://`` only. Workers that
            cannot get every byte inline either way.
        device_memory: a learner on a GPU writes each version into device memory lent to
            the workers (among those reading shared memory) whose model lives on that
            same GPU, which copy it device to device (CUDA IPC).
        **sender_options: ``retain_snapshot``, ``heartbeat``, ``repair_after``, ...

    Example::

        scheme = ZMQWeightSyncScheme(mode="pubsub")
        scheme.init_on_sender("policy", model=policy, num_workers=4)
        # in worker i (the scheme pickles into spawned processes):
        scheme.init_on_receiver(model_id="policy", model=local_policy, worker_idx=i)
        scheme.connect()
        # learner:
        scheme.send()            # returns when all 4 workers hold the new version
    """

    def __init__(
        self,
        strategy: Strategy = "tensordict",
        *,
        mode: Mode = "pubsub",
        endpoint: str | None = None,
        timeout: float = 10.0,
        curve_server: CurveServer | None = None,
        curve_client: CurveClient | None = None,
        insecure: bool = False,
        shared_memory: bool | None = None,
        device_memory: bool = True,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        **sender_options: Any,
    ) -> None:
        self.shared_memory = shared_memory
        self.device_memory = device_memory
        self.curve_server = curve_server
        self.curve_client = curve_client
        self.insecure = insecure
        self.mode = as_mode(mode)
        super().__init__(
            strategy,
            transport=_TRANSPORTS[self.mode],
            endpoint=endpoint,
            timeout=timeout,
            connect_timeout=connect_timeout,
            **sender_options,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["curve_server"] = None  # the sender's secret key never leaves the sender
        return state

    def _hub_options(self) -> dict[str, Any]:
        if self._alias_for(self.endpoint) == "memory":
            return {}
        return {
            "curve": self.curve_server,
            "insecure": self.insecure,
            "shared_memory": self.shared_memory,
            "device_memory": self.device_memory,
        }

    def _spoke_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "identity": "auto" if self._worker_idx is None else str(self._worker_idx)
        }
        if self._alias_for(self.endpoint) == "memory":
            return options
        options["curve"] = self.curve_client
        if self._model is not None:
            # The largest frame a worker accepts: its model's size, plus room for the
            # schema. A peer cannot make it allocate more.
            nbytes = sum(t.nbytes for t in ModelTensors(self.strategy).get(self._model).values())
            options["max_message_bytes"] = 2 * nbytes + 64 * 1024 * 1024
        return options
