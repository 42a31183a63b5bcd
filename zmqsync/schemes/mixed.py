"""MixedWeightSyncScheme: one sender for workers on several transports at once.

Users mix local worker processes, workers on other hosts and Ray actors. This scheme
serves them all from ONE :class:`~zmqsync.WeightSender`: one model id, one version
counter, one encoding per version fanned out through every transport, and ``send()``
returns when every targeted worker on every transport acked.
"""

from __future__ import annotations

from typing import Any

from zmqsync.schemes.base import WeightSyncScheme
from zmqsync.schemes.noop import NoWeightSyncScheme
from zmqsync.schemes.zmq import ZMQWeightSyncScheme
from zmqsync.sender import WeightSender
from zmqsync.transport.base import HubTransport, reserved_workers

__all__ = ["MixedWeightSyncScheme"]


class MixedWeightSyncScheme(WeightSyncScheme):
    """Several schemes' transports behind one sender.

    Args:
        *schemes: the member schemes, not yet initialised, e.g. a
            :class:`~zmqsync.MultiProcessWeightSyncScheme` for local pipe workers, a
            :class:`~zmqsync.RayWeightSyncScheme` for actors and a
            :class:`~zmqsync.ZMQWeightSyncScheme` for processes on other hosts. They
            must share one strategy.
        timeout: seconds ``send()`` waits for every targeted worker's ack; by default
            the longest of the members' timeouts.
        connect_timeout: seconds ``connect()`` waits for every worker to join; by
            default the longest of the members' ``connect_timeout``.
        **sender_options: passed to :class:`~zmqsync.WeightSender` (``retain_snapshot``,
            ``heartbeat``, ...); they apply to every transport.

    Worker ids are unique across the fleet. Pipes and actors given as lists are
    numbered in member order: with 2 pipes and 2 actors, the pipe workers are 0 and 1
    and the actors 2 and 3 (give ``{worker_idx: ...}`` mappings to choose). ZeroMQ
    workers pass their own ``worker_idx``, or none and get the lowest free id.

    Example::

        pipes_scheme = MultiProcessWeightSyncScheme()
        ray_scheme = RayWeightSyncScheme()
        zmq_scheme = ZMQWeightSyncScheme("state_dict", endpoint="tcp://0.0.0.0:5555",
                                         curve_server=server_keys)
        scheme = MixedWeightSyncScheme(pipes_scheme, ray_scheme, zmq_scheme)
        scheme.init_on_sender("policy", model=policy, num_workers=6,
                              pipes=[p0, p1], remote_collectors=[a2, a3])
        # workers use their own member: pipes_scheme.init_on_worker("policy", pipe=...),
        # ray_scheme.init_on_worker(...) in the actors, and zmq_scheme (pickled after
        # init_on_sender, so it carries the endpoint) in processes 4 and 5.
        scheme.connect()   # all 6 joined
        scheme.send()      # all 6 hold the new version
    """

    _transport_alias = "mixed"

    def __init__(
        self,
        *schemes: WeightSyncScheme,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        **sender_options: Any,
    ) -> None:
        if not schemes:
            raise ValueError("MixedWeightSyncScheme needs at least one member scheme")
        for scheme in schemes:
            if not isinstance(scheme, WeightSyncScheme) or isinstance(
                scheme, MixedWeightSyncScheme
            ):
                raise TypeError(
                    f"members must be zmqsync schemes with a transport (ZMQ, MultiProcess, "
                    f"Ray); got {scheme!r}"
                )
            if isinstance(scheme, NoWeightSyncScheme):
                raise TypeError(f"{scheme!r} moves no weights: it cannot be a member")
        strategies = {scheme.strategy for scheme in schemes}
        if len(strategies) > 1:
            raise ValueError(
                f"member schemes must share one strategy; got {sorted(strategies)}: build "
                "them all with 'state_dict' or all with 'tensordict'"
            )
        if len({id(scheme) for scheme in schemes}) != len(schemes):
            raise ValueError("the same scheme object was given twice")
        if timeout is None:
            timeout = max(scheme.timeout for scheme in schemes)
        if connect_timeout is None:
            connect_timeout = max(scheme.connect_timeout for scheme in schemes)
        super().__init__(
            strategies.pop(), timeout=timeout, connect_timeout=connect_timeout, **sender_options
        )
        self.schemes: tuple[WeightSyncScheme, ...] = tuple(schemes)

    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Open every member's transport and serve them all from one sender.

        Args:
            model_id: which model (``"policy"``).
            context: optional object providing the model and the members' inputs
                (``pipes``, ``remote_collectors``, ``num_workers``).
            **kwargs: ``model=``, ``num_workers=`` (workers ``0..n-1`` across every
                transport; by default the number of pipes and actors when no member
                lets workers pick their ids, else every worker that connected), each
                member's inputs (``pipes=``, ``remote_collectors=``), and any
                :class:`~zmqsync.WeightSender` option.
        """
        if self._sender is not None:
            raise RuntimeError("init_on_sender() was already called on this scheme")
        for scheme in self.schemes:
            if scheme._sender is not None or scheme._receiver is not None:
                raise RuntimeError(
                    f"member {scheme!r} is already initialised: give MixedWeightSyncScheme "
                    "fresh schemes, it initialises them"
                )
        if kwargs.get("model") is None:
            kwargs["model"] = kwargs.pop("source_model", None)
        self._take_model(model_id, context, kwargs)
        num_workers = kwargs.pop("num_workers", getattr(context, "num_workers", None))
        hubs: list[HubTransport] = []
        reserved: set[int] = set()
        fixed = True  # every worker's id is fixed by its transport
        try:
            for scheme in self.schemes:
                scheme._model_id = model_id
                hub = scheme._open_hub(context, kwargs, first_index=max(reserved, default=-1) + 1)
                hubs.append(hub)
                ids = reserved_workers(hub)
                clash = reserved & ids
                if clash:
                    raise ValueError(
                        f"worker ids {sorted(clash)} are given to two transports: worker "
                        "ids must be unique across the fleet"
                    )
                reserved |= ids
                fixed = fixed and bool(ids)
            unused = {"pipes", "remote_collectors"} & kwargs.keys()
            if unused:
                raise ValueError(
                    f"{sorted(unused)} given, but no member scheme takes them: add a "
                    "MultiProcessWeightSyncScheme (pipes) or RayWeightSyncScheme "
                    "(remote_collectors) to the mixed scheme"
                )
            if num_workers is None and fixed and reserved == set(range(len(reserved))):
                num_workers = len(reserved)
            self._num_workers = num_workers
            self._sender = WeightSender(
                hubs,
                num_workers=num_workers,
                **self._settings(model_id),
                **{**self.sender_options, **kwargs},
            )
        except BaseException:
            for hub in hubs:
                hub.close()
            raise
        for scheme, hub in zip(self.schemes, hubs, strict=True):
            scheme._adopt(self._sender, hub, model_id, self._model)
        # The address to query (``zmqsync status``): a network member's, if there is one.
        network = [s.endpoint for s in self.schemes if isinstance(s, ZMQWeightSyncScheme)]
        self.endpoint = network[0] if network else self._sender.endpoint

    def init_on_receiver(
        self, *, model_id: str = "policy", context: Any = None, **kwargs: Any
    ) -> None:
        """Not for a mixed scheme: each worker uses its own transport's member."""
        raise RuntimeError(
            "a worker of a mixed fleet joins through its own transport's scheme: call "
            "init_on_worker on the member (MixedWeightSyncScheme.schemes[i]) that serves it, "
            "e.g. the MultiProcessWeightSyncScheme with pipe=..., not on the mixed scheme"
        )

    @property
    def sender_transports(self) -> dict[int, HubTransport]:
        """Each worker id a transport reserves (pipes, actors), with its hub."""
        if self._sender is None:
            return {}
        return {worker: hub for hub in self._sender.transports for worker in reserved_workers(hub)}

    def __repr__(self) -> str:
        side = "sender" if self._sender else "idle"
        members = ", ".join(type(s).__name__ for s in self.schemes)
        return f"MixedWeightSyncScheme({members}; model_id={self._model_id!r}, {side})"
