"""The optional ``hf`` extra (transformers, datasets): is it installed, and import it or say how to install it.

Nothing else in diloco imports transformers or datasets at module level, so the byte-level GPT
path starts without them. A config that needs them and finds them missing is a one-line error
naming the extra (``pip install 'diloco[hf]'``), raised as the caller's own error class so the
CLI reports it without a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install 'diloco[hf]'"


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (cheap enough for config checks)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module stubbed out in sys.modules
        return False


def missing_message(module: str, needed_for: str) -> str:
    return f"{needed_for} needs the Hugging Face extra ({module} is not installed): {INSTALL_HINT}"


def import_hf(module: str, *, needed_for: str, error: type[Exception]) -> ModuleType:
    """``import module``, or raise ``error`` with one line naming the setting and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(missing_message(module, needed_for)) from None
