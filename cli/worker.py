"""``zmqsync worker ENDPOINT --model module:factory``: an actor that follows a learner."""

from __future__ import annotations

from typing import Annotated

import typer

from zmqsync.tools.worker import ModelWorker, build_model

from ._common import (
    ConnectTimeout,
    CurveSecret,
    CurveServerKey,
    Failover,
    StrategyChoice,
    StrategyOption,
    client_keys,
    console,
    fmt_seconds,
    quiet_logger,
    sigterm_as_interrupt,
    user_errors,
)


def worker(
    endpoint: Annotated[
        str,
        typer.Argument(
            envvar="ZMQSYNC_UPSTREAM",
            help="The learner's (or a relay's) endpoint, as it printed it.",
        ),
    ],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="MODULE:FACTORY that builds "
            "this worker's model (called with no arguments); "
            "the current directory is importable.",
        ),
    ],
    worker_idx: Annotated[
        int | None,
        typer.Option(
            "--worker-idx",
            "-i",
            min=0,
            envvar="ZMQSYNC_WORKER_IDX",
            help="This worker's id, unique in the fleet. Omit it and the learner assigns the "
            "lowest free id (replicas of one container image have no ids of their own).",
        ),
    ] = None,
    strategy: StrategyOption = StrategyChoice["state_dict"],
    timeout: ConnectTimeout = 30.0,
    checksum: Annotated[
        bool,
        typer.Option(
            "--checksum",
            help="Print a digest of the "
            "weights with each version (reads every byte: "
            "slow for large models).",
        ),
    ] = False,
    failover: Failover = None,
    curve_secret: CurveSecret = None,
    curve_server_key: CurveServerKey = None,
) -> None:
    """Build a model from a factory, follow a learner, and apply every version it sends.

    Prints one line per version applied ('worker I  version V ...'). Runs until Ctrl-C;
    a version that does not fit the model is refused (the learner sees why) and the
    worker keeps its weights.
    """
    out, err = console(), console(stderr=True)
    # The receiver logs each refused message; this command reports them itself, once.
    with user_errors(), sigterm_as_interrupt(), quiet_logger("zmqsync.receiver"):
        curve = client_keys(curve_secret, curve_server_key)
        net = build_model(model)
        follower = ModelWorker(
            endpoint,
            net,
            worker_idx=worker_idx,
            strategy=strategy.value,
            timeout=timeout,
            curve=curve,
            failover=failover or [],
        )

        def digest() -> str:
            if not checksum:
                return ""
            from zmqsync import checksum as weights_checksum

            with follower.lock:
                return f"  checksum {weights_checksum(net, strategy.value)}"

        try:
            version = follower.connect()
            out.print(
                f"worker {follower.worker_idx}  version {version}  applied on connect to "
                f"{endpoint}{digest()}",
                soft_wrap=True,
            )
            last_reason = ""
            while True:
                applied = follower.wait_for_version(timeout=1.0)
                for reason in follower.new_rejections():
                    # The learner resends a refused version on every heartbeat: say it once.
                    if reason != last_reason:
                        err.print(
                            f"warning: worker {follower.worker_idx} refused a message: {reason}; "
                            "it keeps its current weights",
                            soft_wrap=True,
                        )
                        last_reason = reason
                if applied is not None:
                    stats = follower.stats
                    out.print(
                        f"worker {follower.worker_idx}  version {applied}  applied in "
                        f"{fmt_seconds(stats['last_apply_s'])}{digest()}",
                        soft_wrap=True,
                    )
        except KeyboardInterrupt:
            out.print(f"worker {follower.worker_idx}: stopped at version {follower.version}")
        finally:
            follower.close()
