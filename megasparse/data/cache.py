"""Build-once cache directories that are safe when many ranks (or nodes) start at the same time.

A cached artifact is a directory with a ``DONE`` marker. The builder takes an exclusive ``flock`` on
``<dir>.lock``, builds into ``<dir>.tmp-<pid>`` and renames it into place with the marker already inside,
so readers see a complete directory or none; the rename also keeps two builders on a filesystem without
working locks from mixing files. Processes that are not builders only wait for the marker.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megasparse.data.indexed import DataError

DEFAULT_CACHE = "~/.cache/megasparse"
DONE = "DONE"


def resolve_cache_dir(cache_dir: str | None = None) -> Path:
    """``cache_dir`` if given and not the default; else ``$MEGASPARSE_CACHE``; else ``~/.cache/megasparse``."""
    if cache_dir and cache_dir != DEFAULT_CACHE:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("MEGASPARSE_CACHE") or DEFAULT_CACHE).expanduser()


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK, else RANK, else 0)."""
    for var in ("LOCAL_RANK", "RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def log(msg: str) -> None:
    print(f"[megasparse.data] {msg}", file=sys.stderr, flush=True)


def build_once(
    target: str | os.PathLike,
    build: Callable[[Path], None],
    *,
    builder: bool = True,
    timeout_s: float | None = None,
) -> Path:
    """Return ``target`` after making sure it was built exactly once.

    ``build(tmp_dir)`` fills a fresh directory that then becomes ``target``. With ``builder=False`` this
    process never builds; it polls for the marker (``$MEGASPARSE_DATA_WAIT`` seconds, default 3600).
    """
    target = Path(target)
    if (target / DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not builder:
        limit = timeout_s if timeout_s is not None else float(os.environ.get("MEGASPARSE_DATA_WAIT", "3600"))
        t0, said = time.monotonic(), False
        while not (target / DONE).exists():
            if time.monotonic() - t0 > limit:
                raise DataError(
                    f"waited {limit:.0f}s for {target / DONE}; the building rank (local rank 0) failed or is "
                    "slow: check its log, or run `megasparse prepare-data` once before launching"
                )
            if not said:
                log(f"waiting for local rank 0 to build {target}")
                said = True
            time.sleep(0.2)
        return target
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (target / DONE).exists():
                return target
            tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                build(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            (tmp / DONE).write_text(f"built by pid {os.getpid()} at {time.ctime()}\n")
            if (target / DONE).exists():  # another builder won (filesystem without working flock)
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            if target.exists():  # a stale directory from a build killed before its marker
                shutil.rmtree(target)
            os.replace(tmp, target)  # publishes the directory and its marker at once
            return target
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
