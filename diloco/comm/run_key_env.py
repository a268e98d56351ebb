"""Where a run's key comes from: ``comm.run_key``, else the ``DILOCO_RUN_KEY`` environment variable
(which keeps the key out of config files and shell history). A config written to disk carries the
key masked (``MASKED_RUN_KEY``), which stands for "set elsewhere", never for a key. What the key
protects is ``comm/hivemind/run_key.py``'s."""

from __future__ import annotations

import os

RUN_KEY_ENV = "DILOCO_RUN_KEY"
MASKED_RUN_KEY = "<set>"  # what a written or printed config shows instead of the key


def resolve_run_key(configured: str) -> str:
    """``comm.run_key`` if set (and not the mask a written config carries), else
    ``$DILOCO_RUN_KEY``, else "" (an open run)."""
    if configured and configured != MASKED_RUN_KEY:
        return configured
    return os.environ.get(RUN_KEY_ENV, "")
