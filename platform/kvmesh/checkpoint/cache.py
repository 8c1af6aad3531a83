"""kvmesh's on-disk cache: where converted checkpoints live, and how one is built once.

A cached folder is complete when its `.complete` marker holds exactly the JSON its
builder expects (source identity + format version); anything else is stale and rebuilt.
Builds are crash-safe (work happens in a temp sibling, renamed into place only once the
marker is written) and serialised across processes by an flock, so the loser of any
race reuses the winner's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MARKER = ".complete"


def cache_dir() -> Path:
    """Root of kvmesh's on-disk cache: $KVMESH_CACHE_DIR, else ~/.cache/kvmesh."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"


def is_complete(folder: Path, marker: dict) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def build_once(target: Path, marker: dict, build: Callable[[Path], None], lock: Path) -> Path:
    """`target`, built by `build(tmp_folder)` unless already complete with `marker`; `lock` is the
    flock file every builder of `target` shares."""
    if is_complete(target, marker):
        return target  # fast path: no lock, no heavy imports

    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        if is_complete(target, marker):
            return target  # another process built it while we waited
        # Every builder holds the lock, so any temp sibling left now is from a crashed
        # run, and a folder without a valid marker is stale: clear both.
        for leftover in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            build(tmp)
            (tmp / MARKER).write_text(json.dumps(marker))  # written last
            try:
                os.rename(tmp, target)
            except OSError:
                # Lost a race to a process that skipped the lock: use its folder if good.
                if not is_complete(target, marker):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
