"""The hand-written pyzmq baseline: what a skilled person would write for the same job.

Same job as zmqsync's ``send()``: get the learner's current state_dict into every
worker's own tensors, in place, and return once all K workers said so.

- Learner: ``PUB`` (pubsub) or ``ROUTER`` (router) sends ``[header, *tensor buffers]``
  with ``send_multipart(copy=False)`` from ``memoryview``s of the tensors (zero-copy at
  and above pyzmq's ``copy_threshold``, 64 KiB; below it pyzmq copies, which is what a
  hand-writer gets by default). One frame per tensor, no packing of small tensors: the
  obvious hand-written shape, and the one the issue's "2,000 tensors of 4 KB" case
  exists to stress.
- Workers: ``SUB`` / ``DEALER`` ``recv_multipart(copy=False)``, then per frame
  ``torch.frombuffer`` + ``copy_`` into their preallocated tensors, then an ack over
  ``PUSH`` -> ``PULL``. The learner waits for K acks of that version.
- Slow joiners, without sleeping: in pubsub the learner publishes probes until every
  worker has answered one over PUSH (so its subscription is live); in router each
  worker's DEALER says hello, which both proves the connection and gives its identity.

What it leaves out (and zmqsync does not): versions that never go backwards across
restarts, schema checks before applying, late joiners, repairs, timeouts that name the
missing workers, status. Those are what zmqsync's extra time, if any, pays for.
"""

from __future__ import annotations

import struct
import threading
import time
import traceback
from typing import Any, Final

import torch
import zmq

#: kind (1 byte), version (8 bytes).
HEADER: Final = struct.Struct("!BQ")
#: kind, version, worker.
ACK: Final = struct.Struct("!BQI")
DATA: Final = 1
PROBE: Final = 2
READY: Final = 3
HELLO: Final = 4
ACKED: Final = 5
#: How long the worker thread blocks in one poll before looking at its stop flag.
WORKER_POLL_MS: Final = 100


class BaselineLearner:
    """The learner's end of the baseline: binds, handshakes, sends, waits for acks."""

    def __init__(self, mode: str, transport: str, workdir: str, tag: str) -> None:
        if mode not in ("pubsub", "router"):
            raise ValueError(f"mode must be 'pubsub' or 'router'; got {mode!r}")
        self.mode = mode
        self.ctx = zmq.Context()
        self.version = 0
        self.peers: list[bytes] = []
        kind = zmq.PUB if mode == "pubsub" else zmq.ROUTER
        self.data = self.ctx.socket(kind)
        self.data.linger = 0
        if mode == "router":
            self.data.router_mandatory = 1  # a vanished worker is an error, not a silent drop
        self.acks = self.ctx.socket(zmq.PULL)
        self.acks.linger = 0
        self.data_endpoint = self._bind(self.data, transport, workdir, f"{tag}-data")
        self.ack_endpoint = self._bind(self.acks, transport, workdir, f"{tag}-acks")

    @staticmethod
    def _bind(sock: zmq.Socket[Any], transport: str, workdir: str, name: str) -> str:
        if transport == "tcp":
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            return f"tcp://127.0.0.1:{port}"
        endpoint = f"ipc://{workdir}/{name}"
        sock.bind(endpoint)
        return endpoint

    def handshake(self, num_workers: int, timeout: float) -> None:
        """Return once all ``num_workers`` workers can receive (no sleeps)."""
        deadline = time.monotonic() + timeout
        ready: set[int] = set()
        if self.mode == "router":
            peers: dict[int, bytes] = {}
            while len(peers) < num_workers:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.data.poll(int(remaining * 1000)):
                    raise TimeoutError(
                        f"baseline: workers {sorted(set(range(num_workers)) - peers.keys())} "
                        f"never said hello within {timeout:g}s"
                    )
                identity, msg = self.data.recv_multipart()
                kind, _, worker = ACK.unpack(msg)
                if kind == HELLO:
                    peers[worker] = identity
            self.peers = [peers[w] for w in sorted(peers)]
            return
        interval = 0.001
        while len(ready) < num_workers:
            self.data.send(HEADER.pack(PROBE, 0))
            wait_until = min(deadline, time.monotonic() + interval)
            while len(ready) < num_workers:
                remaining = wait_until - time.monotonic()
                if remaining <= 0 or not self.acks.poll(max(1, int(remaining * 1000))):
                    break
                kind, _, worker = ACK.unpack(self.acks.recv())
                if kind == READY:
                    ready.add(worker)
            if time.monotonic() >= deadline and len(ready) < num_workers:
                raise TimeoutError(
                    f"baseline: workers {sorted(set(range(num_workers)) - ready)} did not see a "
                    f"probe within {timeout:g}s"
                )
            interval = min(0.1, interval * 2)

    def send(self, state_dict: dict[str, torch.Tensor], num_workers: int, timeout: float) -> None:
        """Send the state_dict and return once ``num_workers`` acks of it came back."""
        self.version += 1
        frames: list[Any] = [HEADER.pack(DATA, self.version)]
        # memoryviews: no copy (from a GPU: one copy to the host, the usual `.cpu()`)
        frames += [t.cpu().numpy().data for t in state_dict.values()]
        if self.mode == "pubsub":
            self.data.send_multipart(frames, copy=False)
        else:
            for peer in self.peers:
                self.data.send_multipart([peer, *frames], copy=False)
        acked: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(acked) < num_workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.acks.poll(max(1, int(remaining * 1000))):
                raise TimeoutError(
                    f"baseline: workers {sorted(set(range(num_workers)) - acked)} did not ack "
                    f"version {self.version} within {timeout:g}s"
                )
            kind, version, worker = ACK.unpack(self.acks.recv())
            if kind == ACKED and version == self.version:
                acked.add(worker)

    def close(self) -> None:
        self.data.close(linger=0)
        self.acks.close(linger=0)
        self.ctx.term()


class BaselineWorker:
    """A worker's end of the baseline: a thread that applies every version it receives."""

    def __init__(
        self,
        worker: int,
        mode: str,
        data_endpoint: str,
        ack_endpoint: str,
        state_dict: dict[str, torch.Tensor],
    ) -> None:
        self.worker = worker
        self.state_dict = state_dict
        self.tensors = list(state_dict.values())
        self.lock = threading.Lock()
        self.error: str | None = None
        self.version = 0
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.push.connect(ack_endpoint)
        if mode == "pubsub":
            self.data = self.ctx.socket(zmq.SUB)
            self.data.subscribe(b"")
        else:
            self.data = self.ctx.socket(zmq.DEALER)
            self.data.routing_id = f"worker-{worker}".encode()
        self.data.linger = 0
        self.data.connect(data_endpoint)
        if mode == "router":
            self.data.send(ACK.pack(HELLO, 0, worker))
        self._ready_sent = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="baseline-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.data.poll(WORKER_POLL_MS):
                    continue
                frames = self.data.recv_multipart(copy=False)
                kind, version = HEADER.unpack(frames[0].bytes)
                if kind == PROBE:
                    if not self._ready_sent:
                        self.push.send(ACK.pack(READY, 0, self.worker))
                        self._ready_sent = True
                    continue
                self._apply(frames[1:])
                self.version = version
                self.push.send(ACK.pack(ACKED, version, self.worker))
        except Exception:  # reported to the learner at the next digest
            self.error = traceback.format_exc()

    def _apply(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != len(self.tensors):
            raise ValueError(f"got {len(frames)} tensors, expected {len(self.tensors)}")
        with self.lock:
            for dst, frame in zip(self.tensors, frames, strict=True):
                src = torch.frombuffer(frame.buffer, dtype=dst.dtype)
                if src.numel() != dst.numel():
                    raise ValueError(
                        f"frame of {src.numel()} elements for a tensor of {dst.numel()}"
                    )
                dst.view(-1).copy_(src)
            if dst.is_cuda:
                torch.cuda.synchronize(dst.device)  # applied before the ack says so

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.data.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()
