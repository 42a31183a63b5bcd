# The C extension's interface (zmqsync/tensors/_streamcopy.c); each buffer holds uint64.
STREAMING: int

def fan_out(sources: object, sizes: object, dests: object, k: int, threads: int, /) -> None: ...
