"""The zmqsync command line (installed as ``zmqsync_cli``)."""
