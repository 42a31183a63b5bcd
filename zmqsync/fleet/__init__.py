"""The fleet core, sans-IO: who may say what to a sender, and what the sender does then.

The rules, each enforced in :mod:`zmqsync.fleet.core` and nowhere else:

- A worker's record (a *session*) comes only from a Hello over an identified
  connection; the Welcome carries a secret that every later ack, request, reading note
  and goodbye must carry, from the same connection (acks may come over the shared ack
  channel).
- A claim on an id another live connection holds is refused; auto-assignment hands out
  only ids that no session holds and no hub reserves.
- The ack channel carries acks only. No request is answered by a send to the fleet:
  a snapshot goes to its asker alone, a probe is rate-limited per session.
- Sessions expire when quiet; the table and the status rows are bounded.

Its modules: ``records`` (where a message came from, the effects, a session), ``views``
(what the table says: status, who is live), ``sends`` (whom a version goes to and waits
for), ``core`` (the rules). Their public names are this package's.
"""

from zmqsync.fleet import core, records, sends, views
from zmqsync.fleet.core import *  # noqa: F403
from zmqsync.fleet.records import *  # noqa: F403
from zmqsync.fleet.sends import *  # noqa: F403
from zmqsync.fleet.views import *  # noqa: F403

__all__: list[str] = []
__all__ += records.__all__
__all__ += views.__all__
__all__ += sends.__all__
__all__ += core.__all__
