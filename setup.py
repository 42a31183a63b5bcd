"""The packages: every ``zmqsync*`` package setuptools finds, and the command line, which
lives in ``cli/`` and installs as ``zmqsync_cli``. Everything else is in pyproject.toml,
which can hold a find directive or a list of packages, not both."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["zmqsync", "zmqsync.*"]), "zmqsync_cli"])
