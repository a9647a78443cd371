"""The ``dar`` command's old entry point, ``api.cli:main``: a console script installed before
the command moved to :mod:`cli.main` still imports it. Not part of the API; nothing else
imports it (reinstall, ``pip install -e .``, to point the script at ``cli.main``)."""

from cli.main import main as main

__all__ = ["main"]
