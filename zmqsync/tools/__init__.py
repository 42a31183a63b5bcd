"""The tools built on the library: what the ``zmqsync`` command line runs, as calls.

Asking a sender its status (:mod:`.status`), publishing checkpoints (:mod:`.checkpoints`),
a worker process (:mod:`.worker`), the demo (:mod:`.demo`), the Prometheus exporter
(:mod:`.metrics`), and their names under one roof (:mod:`.client`). They import the
library; nothing in it imports them.
"""
