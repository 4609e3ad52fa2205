"""Where specache keeps its files: converted models, native kernels and the document store."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECACHE_CACHE_DIR, else $XDG_CACHE_HOME/specache, else ~/.cache/specache."""
    if os.environ.get("SPECACHE_CACHE_DIR"):
        return Path(os.environ["SPECACHE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specache"
