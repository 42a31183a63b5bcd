"""ZMQWeightSyncScheme: weight sync over ZeroMQ, fan-out or addressed."""

from __future__ import annotations

from typing import Any, Literal

from zmqsync.schemes.base import WeightSyncScheme

__all__ = ["ZMQWeightSyncScheme"]

_MODES = {"pubsub": "zmq-pubsub", "router": "zmq-router"}


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
        strategy: Literal["state_dict", "tensordict"] = "tensordict",
        *,
        mode: Literal["pubsub", "router"] = "pubsub",
        endpoint: str | None = None,
        timeout: float = 10.0,
        **sender_options: Any,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be 'pubsub' or 'router'; got {mode!r}")
        self.mode = mode
        super().__init__(
            strategy, transport=_MODES[mode], endpoint=endpoint, timeout=timeout, **sender_options
        )
