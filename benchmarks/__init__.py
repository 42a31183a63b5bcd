"""zmqsync's benchmark harness (not part of the library or the test run).

``python -m benchmarks.sync_latency`` measures how long ``scheme.send()`` takes to reach
every worker, next to a hand-written pyzmq baseline doing the same work; see
``benchmarks/README.md``.
"""
