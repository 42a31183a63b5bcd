"""What the ``zmqsync`` command line does, as a library, under one name.

The commands are thin shells over these; each name lives in the module of its idea:
:mod:`zmqsync.tools.status` (ask and judge a sender), :mod:`zmqsync.tools.checkpoints`
(``serve``), :mod:`zmqsync.tools.worker` (``worker``), :mod:`zmqsync.tools.demo`
(``demo``), :mod:`zmqsync.security` (``keys``) and :mod:`zmqsync.endpoints`. Nothing here imports
typer, rich or torch: the same calls work from a notebook or a script.
"""

from __future__ import annotations

from zmqsync.endpoints import check_connectable, reachable_from_other_hosts
from zmqsync.errors import CheckpointError, FactoryError
from zmqsync.security import (
    create_curve_keypair,
    curve_client_from_files,
    curve_server_from_files,
)
from zmqsync.tools.checkpoints import CheckpointPublisher, PublishResult, load_checkpoint
from zmqsync.tools.demo import LocalFleet, demo_model
from zmqsync.tools.status import (
    DEFAULT_SILENT_AFTER,
    DEFAULT_STATUS_TIMEOUT,
    RankRow,
    assess,
    query_ranks,
    query_status,
    rank_problems,
    worker_problem,
)
from zmqsync.tools.worker import ModelWorker, build_model, load_factory

__all__ = [
    "DEFAULT_SILENT_AFTER",
    "DEFAULT_STATUS_TIMEOUT",
    "CheckpointError",
    "CheckpointPublisher",
    "FactoryError",
    "LocalFleet",
    "ModelWorker",
    "PublishResult",
    "RankRow",
    "assess",
    "build_model",
    "check_connectable",
    "create_curve_keypair",
    "curve_client_from_files",
    "curve_server_from_files",
    "demo_model",
    "load_checkpoint",
    "load_factory",
    "query_ranks",
    "query_status",
    "rank_problems",
    "reachable_from_other_hosts",
    "worker_problem",
]
