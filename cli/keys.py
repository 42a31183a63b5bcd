"""``zmqsync keys DIR``: ZeroMQ CURVE key pairs for authenticated, encrypted endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zmqsync.security import create_curve_keypair

from ._common import console, user_errors


def keys(
    directory: Annotated[
        Path, typer.Argument(help="Directory to write the keys to (created if missing).")
    ],
    name: Annotated[
        str, typer.Option(help="Base name of the key files: NAME.key and NAME.key_secret.")
    ] = "zmqsync",
    force: Annotated[
        bool, typer.Option("--force", help="Replace existing keys of that name.")
    ] = False,
) -> None:
    """Generate a ZeroMQ CURVE key pair: NAME.key (public) and NAME.key_secret.

    Make one pair for the learner and one per worker (or one shared by the fleet); give
    each side the other's public key. The secret file is readable by you only.
    """
    with user_errors():
        public, secret = create_curve_keypair(directory, name, force=force)
    out = console()
    out.print(f"public key: {public}  (give this to the other side)", soft_wrap=True)
    out.print(f"secret key: {secret}  (keep it private; mode 600)", soft_wrap=True)
