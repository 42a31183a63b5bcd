"""MultiProcessWeightSyncScheme: weight sync with worker processes over pipes.

torchrl's scheme of the same name, on zmqsync's pipe transport: the same
versioned frames as the ZeroMQ schemes (tensor bytes, never pickled tensors), acks back
through the same pipe. Unlike torchrl's, a worker never aliases the sender's memory (it
holds its own copy, changed only by a send) and ``worker_ids`` reaches only the named
workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from zmqsync.receiver import WeightReceiver
from zmqsync.schemes.base import DEFAULT_CONNECT_TIMEOUT, WeightSyncScheme
from zmqsync.schemes.options import numbered, receiver_options
from zmqsync.transport.pipe import PipeHub, PipeSpoke
from zmqsync.vocabulary import Strategy

__all__ = ["MultiProcessWeightSyncScheme"]

Pipes = Sequence[Connection] | Mapping[int, Connection]


class MultiProcessWeightSyncScheme(WeightSyncScheme):
    """Weight synchronization for worker processes, over one duplex pipe per worker.

    Args:
        strategy: ``"state_dict"`` (default, as torchrl's) or ``"tensordict"``.
        timeout: seconds ``send()`` waits for every targeted worker's ack.
        connect_timeout: seconds ``connect()`` waits by default: the sender for its
            workers, a worker for the sender (and ``init_on_worker`` without a
            ``worker_idx`` for the index its pipe assigns).
        device_memory: a learner on a GPU writes each version into device memory lent to
            workers on that GPU (up to three model-sized blocks there; see
            ``docs/gpus.md``); False: versions go through the host.
        **sender_options: passed to :class:`~zmqsync.WeightSender` (``retain_snapshot``,
            ``heartbeat``, ``repair_after``, ...).

    Example::

        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(2)]
        scheme = MultiProcessWeightSyncScheme()
        procs = [ctx.Process(target=worker, args=(scheme, child)) for _, child in pipes]
        for p in procs:
            p.start()
        for _, child in pipes:
            child.close()      # the worker holds it now; a dead worker is then seen at once
        scheme.init_on_sender("policy", pipes=[parent for parent, _ in pipes], model=policy)
        scheme.send()          # returns when both workers hold the new version

        def worker(scheme, pipe):                          # in each worker process
            scheme.init_on_worker("policy", pipe=pipe, model=local_policy)
            scheme.connect()                               # latest weights applied
            scheme.start_receiver_thread()                 # new versions applied as they come

    Each pipe must carry nothing but this scheme's messages. A worker learns its index
    from its pipe, so ``worker_idx`` is optional on the worker side.
    """

    _transport_alias = "pipe"

    def __init__(
        self,
        strategy: Strategy = "state_dict",
        *,
        timeout: float = 10.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        device_memory: bool = True,
        **sender_options: Any,
    ) -> None:
        super().__init__(
            strategy, timeout=timeout, connect_timeout=connect_timeout, **sender_options
        )
        self.device_memory = device_memory

    # --- transports ------------------------------------------------------------------

    def create_transport(
        self,
        pipe: Connection | None = None,
        *,
        role: str = "hub",
        worker_idx: int = 0,
        **options: Any,
    ) -> PipeHub | PipeSpoke:
        """A pipe transport end (legacy): the sender's end of ``pipe`` by default, or the
        worker's with ``role="spoke"``.

        ``create_transport(pipe)`` gives a hub serving the one worker ``worker_idx`` at
        the other end of ``pipe``.
        """
        options.pop("endpoint", None)  # pipes have no address
        if role not in ("hub", "spoke"):
            raise ValueError(f"role must be 'hub' or 'spoke'; got {role!r}")
        if pipe is None:
            raise ValueError(
                "create_transport() needs a pipe: the sender's end of a worker's "
                "multiprocessing.Pipe() (or, with role='spoke', the worker's end)"
            )
        if role == "hub":
            return PipeHub({worker_idx: pipe}, **options)
        return PipeSpoke(pipe)

    # --- sender side -----------------------------------------------------------------

    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Set up the sender over the workers' pipes.

        Args:
            model_id: which model (``"policy"``).
            context: optional object providing ``pipes``, ``num_workers`` and the model
                (``get_model(model_id)`` or an attribute named ``model_id``).
            **kwargs: instead of a context: ``pipes=`` (the sender's end of each worker's
                duplex pipe, a list or ``{worker_idx: pipe}``), ``num_workers=``,
                ``model=``; and any :class:`~zmqsync.WeightSender` option.
        """
        pipes = self._pipes(context, kwargs)
        indices = sorted(pipes) if isinstance(pipes, Mapping) else list(range(len(pipes)))
        if "num_workers" not in kwargs and getattr(context, "num_workers", None) is not None:
            kwargs["num_workers"] = context.num_workers
        if "num_workers" not in kwargs:
            # Workers 0..n-1 are send()'s default targets; with other indices, whoever
            # has connected.
            contiguous = indices == list(range(len(indices)))
            kwargs["num_workers"] = len(indices) if contiguous else None
        num_workers = kwargs["num_workers"]
        if num_workers is not None and not set(range(num_workers)) <= set(indices):
            raise ValueError(
                f"num_workers={num_workers} but pipes were given for workers {indices}: give "
                "one pipe per worker 0..num_workers-1 (or num_workers=None to target whichever "
                "workers have connected)"
            )
        super().init_on_sender(model_id, context, pipes=pipes, **kwargs)

    def _open_hub(self, context: Any, kwargs: dict[str, Any], *, first_index: int = 0) -> PipeHub:
        pipes = numbered(self._pipes(context, kwargs), first_index)
        return PipeHub(pipes, device_memory=self.device_memory)

    def _pipes(self, context: Any, kwargs: dict[str, Any]) -> Pipes:
        """The workers' pipes, from ``pipes=`` (popped) or ``context.pipes``."""
        return self._given(kwargs, context, "pipes", "the workers' pipes (the sender's ends)")

    def add_pipe(self, pipe: Connection, worker_idx: int) -> None:
        """Serve one more worker on ``pipe`` (the sender's end), or a restarted worker in
        place of one whose pipe broke. It joins at the latest version."""
        hub = self.get_sender().transport
        assert isinstance(hub, PipeHub)
        hub.add_pipe(pipe, worker_idx)

    # --- worker side -----------------------------------------------------------------

    def init_on_receiver(
        self, *, model_id: str = "policy", context: Any = None, **kwargs: Any
    ) -> None:
        """Set up a worker on its end of the pipe (``connect()`` then joins).

        Args:
            model_id: which model.
            context: optional object providing ``pipe``, ``worker_idx`` and the model.
            **kwargs: ``pipe=`` (this worker's end), ``model=``, and optionally
                ``worker_idx=`` (by default the index the sender's pipe assigns),
                ``apply_mode=`` and ``chunk_timeout=`` (see :class:`WeightReceiver`).
        """
        if self._receiver is not None:
            raise RuntimeError("init_on_receiver() was already called on this scheme")
        pipe = self._given(kwargs, context, "pipe", "this worker's end of its pipe")
        self._take_model(model_id, context, kwargs)
        worker_idx = kwargs.pop("worker_idx", getattr(context, "worker_idx", None))
        options = receiver_options(kwargs)
        if kwargs:
            raise TypeError(f"unexpected arguments for init_on_worker: {sorted(kwargs)}")
        spoke = PipeSpoke(pipe)
        try:
            if worker_idx is None:
                # Part of joining: the sender assigns it as it starts serving the pipe.
                worker_idx = spoke.wait_index(self.connect_timeout)
            self._worker_idx = int(worker_idx)
            self._receiver = WeightReceiver(
                spoke, worker_idx=self._worker_idx, **self._settings(model_id), **options
            )
        except BaseException:
            spoke.close()
            raise
