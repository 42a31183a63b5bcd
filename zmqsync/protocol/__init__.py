"""The zmqsync wire protocol, sans-IO: messages as values, a codec to and from buffers.

Nothing here touches sockets, threads or torch (like h11), so it can be fuzzed alone.
Its modules, each built on those before it: ``limits`` (what a message may announce),
``messages`` (the values), ``wire`` (the binary layouts), ``schemas`` (a version's schema
JSON), ``slices`` (the slices a worker declares), ``chunks`` (a chunk's frames), ``codec``
(any message's frames); ``stream`` follows one version's chunks at a receiver. Their
public names are this package's.
"""

from zmqsync.protocol import chunks, codec, limits, messages, schemas, slices, wire
from zmqsync.protocol.chunks import *  # noqa: F403
from zmqsync.protocol.codec import *  # noqa: F403
from zmqsync.protocol.limits import *  # noqa: F403
from zmqsync.protocol.messages import *  # noqa: F403
from zmqsync.protocol.schemas import *  # noqa: F403
from zmqsync.protocol.slices import *  # noqa: F403
from zmqsync.protocol.wire import *  # noqa: F403
from zmqsync.vocabulary import STRATEGIES

__all__ = ["STRATEGIES"]
__all__ += limits.__all__
__all__ += messages.__all__
__all__ += wire.__all__
__all__ += schemas.__all__
__all__ += chunks.__all__
__all__ += codec.__all__
__all__ += slices.__all__
