"""The errors a user has to fix. The command line prints each as one line (``diloco: error: ...``)
and exits with code 2, no traceback. A leaf: it imports nothing of diloco, so that any module,
at any layer, can raise them.

    UserError       the base: a mistake the user has to fix; its message is one line
      UsageError    the command line (a flag, a benchmark's arguments)
      ConfigError   a configuration key or value, or a model that cannot fit in memory
      DataError     the data: a path that is not there, a corpus too small to sample
      CommError     the transport: a port taken, no peer reachable, no run to join
      PlotError     a run directory that cannot be plotted

and two helpers for the checks beside each setting's code: ``require`` (a condition) and
``make_folder`` (a folder a setting names, created, or one line where it cannot be).
"""

from __future__ import annotations

from pathlib import Path


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


def make_folder(path: Path, setting: str, error: type[UserError] = UserError, *, shown: Path | None = None) -> Path:
    """``path`` created with its parents if missing; ``error`` naming ``setting`` (as ``shown``, by
    default ``path``) where it cannot be: a file in its way, a place nobody can write such as
    ``/proc/x``, a read-only disk."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as failure:
        in_the_way = next((p for p in (path, *path.parents) if p.is_file()), None)
        why = f"{in_the_way} is a file" if in_the_way is not None else failure.strerror
        where = path if shown is None else shown
        raise error(f"{setting}={where} cannot be created ({why}): point {setting} at a place you can write") from None
    return path
