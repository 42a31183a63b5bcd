"""The packages: every ``zmqsync*`` package setuptools finds, and the command line, which
lives in ``cli/`` and installs as ``zmqsync_cli``. Everything else is in pyproject.toml,
which can hold a find directive or a list of packages, not both.

One C extension, ``zmqsync.tensors._streamcopy``: the copies that write a version into
memory other processes read (streaming stores, see the source). It is optional: where no
C compiler is found the build goes on without it, and zmqsync copies with torch
(``zmqsync.tensors.streaming.AVAILABLE`` says which)."""

from setuptools import Extension, find_packages, setup

setup(
    packages=[*find_packages(include=["zmqsync", "zmqsync.*"]), "zmqsync_cli"],
    ext_modules=[
        Extension(
            "zmqsync.tensors._streamcopy",
            sources=["zmqsync/tensors/_streamcopy.c"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ],
)
