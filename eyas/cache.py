"""Where Eyas keeps what it makes once per machine: converted checkpoints, compiled CPU kernels,
feature caches (``EYAS_CACHE``; default ``~/.cache/eyas``). A leaf: it imports nothing of Eyas."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EYAS_CACHE"


def cache_root() -> Path:
    """The cache folder (not created here)."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "eyas"))
