"""Sender and worker processes that live on namespace hosts (see netns.py).

Each runs in a spawned process that first enters its host's network namespace, then is
driven by the test over a control pipe (test harness only; weights travel over zmqsync).
Workers record every version they apply as ``(epoch, version, checksum)``; the sender
records the checksum of every version it sends, so a test can prove no worker ever
applied a mixed version and no worker went backwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any

import torch
from netns import enter_netns
from torch import nn

import zmqsync

SPAWN = mp.get_context("spawn")


def make_model(mb: float, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    width = max(8, int((mb * 1024 * 1024 / 4 / 4) ** 0.5))
    return nn.Sequential(
        nn.Linear(width, width),
        nn.Linear(width, width),
        nn.Linear(width, width),
        nn.Linear(width, width),
    )


def host_worker(
    ns: str,
    scheme: Any,
    worker_idx: int,
    mb: float,
    slow_apply: float,
    conn: Any,
    failover: tuple[str, ...] = (),
) -> None:
    try:
        enter_netns(ns)
        model = make_model(mb, seed=1000 + worker_idx)
        scheme.init_on_receiver(
            model_id="policy", model=model, worker_idx=worker_idx, failover=list(failover)
        )
        receiver = scheme.get_receiver()
        history: list[tuple[int, int, str]] = []

        def record(epoch: int, version: int) -> None:
            history.append((epoch, version, zmqsync.checksum(model, scheme.strategy)))
            if slow_apply:
                time.sleep(slow_apply)  # a slow worker: its ack comes late

        receiver.on_applied.append(record)
        scheme.connect(timeout=30)
        scheme.start_receiver_thread()
        conn.send("ready")
        while True:
            if not conn.poll(0.05):
                continue
            command = conn.recv()
            if command == "stop":
                break
            with scheme.lock:
                conn.send(
                    {
                        "epoch": receiver.epoch,
                        "version": receiver.version,
                        "history": list(history),
                        "stats": dict(receiver.stats),
                    }
                )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        scheme.shutdown()


def host_sender(ns: str, options: dict[str, Any], mb: float, num_workers: int, conn: Any) -> None:
    try:
        enter_netns(ns)
        model = make_model(mb, seed=0)
        scheme = zmqsync.ZMQWeightSyncScheme("state_dict", **options)
        scheme.init_on_sender("policy", model=model, num_workers=num_workers)
        sender = scheme.get_sender()
        # Version 0: the weights it started with, what a worker gets when it connects.
        conn.send(("ready", scheme, (sender.epoch, 0, zmqsync.checksum(model))))
        while True:
            if not conn.poll(0.05):
                continue
            command, *args = conn.recv()
            if command == "stop":
                break
            if command == "send":
                worker_ids, timeout = args
                sender.timeout = timeout
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p))
                sent = (sender.epoch, sender.version + 1, zmqsync.checksum(model))
                conn.send(("sending", sent))  # first: the test still knows it if we die
                start = time.monotonic()
                try:
                    scheme.send(worker_ids=worker_ids)
                    conn.send(("ok", sent, time.monotonic() - start, []))
                except zmqsync.SyncTimeout as exc:
                    conn.send(("timeout", sent, time.monotonic() - start, exc.missing_workers))
            elif command == "status":
                conn.send(scheme.status())
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        scheme.shutdown()


def host_relay(
    ns: str,
    upstream: str,
    endpoint: str,
    relay_idx: int,
    keys: tuple[Any, Any],
    conn: Any,
) -> None:
    """A relay on its own host: ``keys`` are its CURVE server (downstream) and client
    (upstream) keys."""
    relay = None
    try:
        enter_netns(ns)
        server, client = keys
        relay = zmqsync.Relay.over_zmq(
            upstream,
            endpoint,
            curve_server=server,
            curve_client=client,
            strategy="state_dict",
            worker_idx=relay_idx,
            heartbeat=0.5,
            timeout=30,
        )
        relay.connect(timeout=30)
        relay.start()
        conn.send("ready")
        while True:
            if not conn.poll(0.05):
                continue
            if conn.recv() == "stop":
                break
            conn.send(relay.status())
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if relay is not None:
            relay.close()


class Proc:
    """A spawned host process and its control pipe."""

    def __init__(self, target: Any, *args: Any, **kwargs: Any) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(*args, child), kwargs=kwargs, daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 60.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"host process {self.proc.pid} did not answer in {timeout}s")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise AssertionError(f"host process failed:\n{reply[1]}")
        return reply

    def ask(self, command: Any, timeout: float = 60.0) -> Any:
        self.conn.send(command)
        return self.recv(timeout)

    def signal(self, sig: int) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.signal(signal.SIGCONT)
                self.conn.send("stop" if not isinstance(self, SenderProc) else ("stop",))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class SenderProc(Proc):
    pass
