"""torch's side of zmqsync: the only package that imports torch and tensordict.

Sending: :mod:`.extract` a model's tensors (cached by :mod:`.model_tensors`),
:mod:`.flatten` them to buffers, read those into chunks (:mod:`.casts` for
``wire_dtype``, :mod:`.device_reader` off an accelerator, :mod:`.shared_params` for
``share_params``). Receiving: :mod:`.fit` checks, :mod:`.apply` copies a whole version,
:mod:`.in_place` chunk by chunk, :mod:`.sink_feed` hands tensors to a sink. The stream's
bytes themselves are :mod:`zmqsync.chunking`'s.
"""
