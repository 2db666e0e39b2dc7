"""Exceptions the rewriter raises for problems a user can fix (bad file, bad config).

Everything else (a bug) propagates as usual. The CLI maps :class:`RewriteError` to exit code 2.
"""
from __future__ import annotations


class RewriteError(Exception):
    """A problem with the user's input: model file, output path or configuration."""


class ConfigError(RewriteError, ValueError):
    """An invalid setting, override entry or override file."""


class ModelFileError(RewriteError):
    """The input model cannot be read, or the output cannot be written where asked."""
