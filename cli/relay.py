"""``zmqsync relay UPSTREAM``: forwards a learner's versions to workers of its own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from zmqsync.relay import Relay

from ._common import (
    ConnectTimeout,
    CurveRelays,
    CurveSecret,
    CurveServerKey,
    Failover,
    MetricsAddr,
    MetricsPort,
    ModeChoice,
    StrategyChoice,
    StrategyOption,
    Workers,
    client_keys,
    console,
    quiet_logger,
    refuse_exposed,
    server_keys,
    serving_metrics,
    sigterm_as_interrupt,
    user_errors,
)


def relay(
    upstream: Annotated[
        str,
        typer.Argument(
            envvar="ZMQSYNC_UPSTREAM",
            help="The learner's (or an upper relay's) endpoint, as it printed it; of a "
            "sharded learner, rank 0's (its Welcome names the other ranks).",
        ),
    ],
    endpoint: Annotated[
        str | None,
        typer.Option(
            help="Where this relay's workers connect: tcp://HOST:PORT, tcp://HOST:* or "
            "ipc:///PATH. Default: an ipc path in a new private directory, printed at start.",
            show_default=False,
        ),
    ] = None,
    mode: Annotated[
        ModeChoice,
        typer.Option(help="How the relay reaches its own workers (see `zmqsync serve`)."),
    ] = ModeChoice["pubsub"],
    relay_idx: Annotated[
        int | None,
        typer.Option(
            "--relay-idx",
            min=0,
            envvar="ZMQSYNC_RELAY_IDX",
            help="This relay's id among the upstream's workers. Default: the upstream assigns one.",
        ),
    ] = None,
    workers: Workers = None,
    strategy: StrategyOption = StrategyChoice["state_dict"],
    timeout: ConnectTimeout = 30.0,
    metrics_port: MetricsPort = None,
    metrics_addr: MetricsAddr = "127.0.0.1",
    failover: Failover = None,
    curve_secret: CurveSecret = None,
    curve_server_key: CurveServerKey = None,  # the upstream's
    curve_clients: Annotated[
        Path | None,
        typer.Option(
            envvar="ZMQSYNC_CURVE_CLIENTS",
            file_okay=False,
            help="Accept only the workers whose public keys (*.key) are in this directory; "
            "needs --curve-secret (this relay's keys, upstream and down).",
        ),
    ] = None,
    snapshot: Annotated[
        bool,
        typer.Option(
            "--snapshot/--no-snapshot",
            help="Keep the latest version (twice its size in memory: the next is staged "
            "apart) for late joiners and repairs; --no-snapshot keeps only the chunks on "
            "their way and fetches the latest again from upstream when a worker needs it.",
        ),
    ] = True,
    curve_relays: CurveRelays = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Listen on an address other hosts can reach without CURVE keys (a "
            "trusted network only).",
        ),
    ] = False,
) -> None:
    """Follow an upstream learner (or relay) and forward every version to workers of its
    own, chunk by chunk as it arrives, holding no model.

    The learner sends each version once per relay; the relay acks a version upstream
    once every worker it serves holds it, and serves its late joiners itself. Of a
    sharded learner, it gathers every rank's part of a version and forwards it whole. Prints
    'zmqsync relay: listening on ENDPOINT' once it listens, then a line per version.
    Runs until Ctrl-C.
    """
    out = console()
    with user_errors(), sigterm_as_interrupt(), quiet_logger("zmqsync.receiver"):
        # One key pair for both ends: a client upstream (with the upstream's public key),
        # a server downstream.
        client = client_keys(curve_secret, curve_server_key) if curve_server_key else None
        server = server_keys(curve_secret, curve_clients, curve_relays)
        refuse_exposed(
            endpoint, server, insecure, who="the relay", how="--curve-secret and --curve-clients"
        )
        node = Relay.over_zmq(
            upstream,
            endpoint,
            mode=mode.value,
            curve_server=server,
            curve_client=client,
            insecure=insecure,
            failover=failover or [],
            strategy=strategy.value,
            worker_idx=relay_idx,
            num_workers=workers,
            timeout=timeout,
            retain_snapshot=snapshot,
        )
        try:
            node.connect(timeout)
            node.start()
            with serving_metrics(node, metrics_port, metrics_addr, out):
                secured = ", CURVE" if server is not None else ""
                out.print(
                    f"zmqsync relay: listening on {node.endpoint} ({mode.value}{secured}), "
                    f"forwarding {upstream} as worker {node.receiver.worker_idx}",
                    soft_wrap=True,
                )
                served = "held, served" if snapshot else "fetched again from upstream"
                out.print(f"version {node.version}: {served} to workers as they connect")
                last = node.version
                while True:
                    time.sleep(0.2)
                    if node.version != last:
                        last = node.version
                        live = node.report().workers_live
                        out.print(f"version {last}: forwarded to {live} worker(s)", soft_wrap=True)
        except KeyboardInterrupt:
            out.print(f"zmqsync relay: stopped at version {node.version}")
        finally:
            node.close()
