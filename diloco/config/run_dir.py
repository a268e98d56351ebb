"""The run directory (``run.dir``, or ``runs/<run.name>``), checked with the config, so that a
file in its place is refused before anything starts. Where it is created (``build_worker``,
``diloco local``), ``errors.make_folder`` makes a place nobody can write (``/proc/x``, a
read-only disk) one line rather than a traceback."""

from __future__ import annotations

from pathlib import Path

from diloco.errors import ConfigError


def check_run_dir(path: Path) -> None:
    """Raise ``ConfigError`` when ``path``, or the nearest of its parents that exists, is not a directory."""
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"run.dir={path} is a file, not a directory: choose another run.dir (or move the file away)"
            )
        existing = next((parent for parent in path.parents if parent.exists()), None)
    except OSError as error:  # a parent this user may not look into
        raise ConfigError(f"run.dir={path} cannot be used ({error.strerror}): choose another run.dir") from None
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"run.dir={path}: {existing} is a file, not a directory: choose another run.dir")
