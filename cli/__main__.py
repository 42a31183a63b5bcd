"""``python -m zmqsync_cli``: the same as the ``zmqsync`` command."""

from .main import main

if __name__ == "__main__":
    main()
