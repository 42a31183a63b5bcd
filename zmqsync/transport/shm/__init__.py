"""Shared-memory lending, for every transport whose peers may share the hub's host.

A hub writes a large frame once into a block of its :mod:`~.blocks` pool (a sender's
snapshot already lies in one) and sends only where it lies, a :class:`~.records.Lease`;
each peer maps the block read-only and copies from it into its model. A block is
rewritten only once every lease on it is released: a peer releases a block once no
frame of it is left alive (:func:`~.borrowing.when_gone`), or is lost.

- :mod:`.blocks`: the hub's blocks and who leases them.
- :mod:`.records`: the records both sides exchange (offer, join, lease, release).
- :mod:`.lending`: the hub's side: the probe a peer proves itself on, building leases.
- :mod:`.borrowing`: a peer's side: mapping blocks, reading leases, releasing.

How the records travel, and whom a hub trusts, is each transport's own (the pipe passes
descriptors; ZeroMQ and Ray peers open the blocks through ``/proc``).
"""
