"""A version as a byte stream cut into chunks: the stream's bytes, without torch.

:mod:`~zmqsync.chunking.layout` says where each tensor lies in the stream and which bytes
each chunk carries; :mod:`~zmqsync.chunking.staging` gathers a received stream in one
buffer; :mod:`~zmqsync.chunking.delta` tracks which blocks of it each version changed;
:mod:`~zmqsync.chunking.copier` splits large copies over threads where there are cores.
Reading tensors into chunks and chunks back into tensors is :mod:`zmqsync.tensors`' part.
"""
