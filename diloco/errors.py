"""The errors a user has to fix. The command line prints each as one line (``diloco: error: ...``)
and exits with code 2, no traceback. A leaf: it imports nothing of diloco, so that any module,
at any layer, can raise them.

    UserError       the base: a mistake the user has to fix; its message is one line
      UsageError    the command line (a flag, a benchmark's arguments)
      ConfigError   a configuration key or value, or a model that cannot fit in memory
      DataError     the data: a path that is not there, a corpus too small to sample
      CommError     the transport: a port taken, no peer reachable, no run to join
      PlotError     a run directory that cannot be plotted
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user has to fix; the message is one line."""


class UsageError(UserError):
    """A mistake in the command line."""


class ConfigError(UserError, ValueError):
    """A configuration the user has to fix."""


class DataError(UserError, ValueError):
    """The corpus cannot be loaded or is too small for the requested sampling."""


class CommError(UserError, RuntimeError):
    """The transport cannot start as configured (port taken, no peer reachable)."""


class PlotError(UserError, ValueError):
    """A run directory that cannot be plotted; the message names it."""


def require(condition: bool, message: str) -> None:
    """A setting's check, beside the code it configures: ``ConfigError(message)`` unless ``condition``."""
    if not condition:
        raise ConfigError(message)
