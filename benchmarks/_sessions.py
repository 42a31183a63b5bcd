"""zmqsync receivers in a benchmark's worker process, by session name: each receives into
a state_dict of its own, in place, on its scheme's background thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._models import SIZES, digest, make_state_dict


class ZmqsyncSessions:
    """A worker's open zmqsync schemes, each with the state_dict it receives into."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}

    def open(
        self,
        name: str,
        scheme: Any,
        size: str,
        init: Callable[[dict[str, torch.Tensor]], object],
        timeout: float,
    ) -> str:
        """A session of ``scheme`` into a fresh state_dict of ``size``: ``init(state_dict)``
        sets the scheme up on this worker (``init_on_receiver`` or ``init_on_worker``),
        then it connects and starts receiving."""
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self._open[name] = (scheme, state_dict)  # closed with the others, even if it fails
        init(state_dict)
        scheme.connect(timeout=timeout)
        scheme.start_receiver_thread()
        return name

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return self._open[name][1]

    def digest(self, name: str) -> dict[str, Any]:
        """The digest of the session's tensors, and its receiver's version and counters."""
        scheme, state_dict = self._open[name]
        receiver = scheme.get_receiver()
        with scheme.lock:
            return {
                "digest": digest(state_dict),
                "version": receiver.version,
                "stats": dict(receiver.stats),
            }

    def close(self) -> int:
        """Shut every scheme down; how many there were."""
        closed = len(self._open)
        for scheme, _ in self._open.values():
            with contextlib.suppress(Exception):
                scheme.shutdown()
        self._open.clear()
        return closed
