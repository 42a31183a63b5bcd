"""The fleet core, sans-IO: who may say what to a sender, and what the sender does then.

The rules, each enforced in :mod:`zmqsync.fleet.core` and nowhere else:

- A worker's record (a *session*) comes only from a Hello over an identified
  connection; the Welcome carries a secret that every later ack, request and goodbye
  must carry, from the same connection (acks may come over the shared ack channel).
- A claim on an id another live connection holds is refused; auto-assignment hands out
  only ids that no session holds and no hub reserves.
- The ack channel carries acks only. No request is answered by a send to the fleet:
  a snapshot goes to its asker alone, a probe is rate-limited per session.
- Sessions expire when quiet; the table and the status rows are bounded.
"""

from zmqsync.fleet.core import EXPIRE_HEARTBEATS, EXPIRE_MIN_SECONDS, MAX_SESSIONS, Fleet
from zmqsync.fleet.records import (
    Effect,
    FanOut,
    Forget,
    Origin,
    Reply,
    Send,
    SendLatest,
    Session,
)
from zmqsync.fleet.views import LIVE_HEARTBEATS, STATUS_ROWS

__all__ = [
    "EXPIRE_HEARTBEATS",
    "EXPIRE_MIN_SECONDS",
    "LIVE_HEARTBEATS",
    "MAX_SESSIONS",
    "STATUS_ROWS",
    "Effect",
    "FanOut",
    "Fleet",
    "Forget",
    "Origin",
    "Reply",
    "Send",
    "SendLatest",
    "Session",
]
