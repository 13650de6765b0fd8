"""One run per output directory, and storage problems named before they cost a run (issue 32).

- ``RunLock``: ``<out_dir>/megasparse.lock`` (host, pid, start time, job id) taken by rank 0 with O_EXCL. A lock is
  stale, and taken over with one line, when its holder is on this host and dead, when it names this job
  (``SLURM_JOB_ID`` / ``TORCHELASTIC_RUN_ID``: an earlier attempt of a requeued or restarted job), or when its
  heartbeat (the file's mtime, refreshed every ``HEARTBEAT_S`` by a daemon thread) is older than ``STALE_S``.
- ``previous_run``: a fresh run (no ``checkpoint.resume``) into a directory that holds another run's checkpoints
  or metrics refuses, or with ``logging.previous_run=move_aside`` moves them into ``previous-<time>/``; nothing
  is ever deleted.
- ``check_storage``: out_dir and checkpoints/ are directories this process can write (a real probe file, so
  read-only mounts and root-owned trees are caught too) with room for one more checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from megasparse.configbase import ConfigError

LOCK = "megasparse.lock"
HEARTBEAT_S = 60.0
STALE_S = 900.0
"""A lock whose heartbeat is this old (15 min) is stale whatever host holds it: its process is gone or frozen."""
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "tensorboard")


class StorageError(ConfigError):
    """A path that cannot hold the run's files: one line with the path and the OS error (exit 2)."""


def os_error_line(path: str | os.PathLike, e: OSError, doing: str) -> str:
    """``cannot write a checkpoint at X: [Errno 28] No space left on device`` — the path and the OS's words."""
    what = e.strerror or type(e).__name__
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    return f"cannot {doing} {path}: {what}{f' ({code})' if code else ''}"


def job_id() -> str:
    """This job across requeues and torchrun restarts ('' outside a scheduler). torchrun's run id is only an id when
    it was given: its default is the literal "none", shared by every job launched without ``--rdzv-id``."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return os.environ.get("SLURM_JOB_ID") or ("" if run == "none" else run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The out_dir lock, held by rank 0 for the whole run."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / LOCK
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "start": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "job": job_id()}  # fmt: skip

    def stale_reason(self, held: dict, age_s: float) -> str | None:
        """Why ``held`` no longer guards the directory, or None when its run may still be alive."""
        me = self._record()
        if held.get("job") and held.get("job") == me["job"]:
            return f"an earlier attempt of this job ({held['job']})"
        if held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
            return f"pid {held['pid']} on this host is gone"
        if age_s > STALE_S:
            return f"its heartbeat is {age_s / 60:.0f} min old"
        return None

    def acquire(self, log=print) -> None:
        """Take the lock, or raise one ConfigError line naming the run that holds it."""
        text = json.dumps(self._record())
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    held = json.loads(self.path.read_text() or "{}")
                    age = time.time() - self.path.stat().st_mtime
                except (OSError, ValueError):
                    held, age = {}, STALE_S + 1  # unreadable or half-written: treat as abandoned
                why = self.stale_reason(held, age)
                if why is None:
                    raise ConfigError(
                        f"logging.out_dir={self.path.parent} is in use by another run (host {held.get('host')}, pid "
                        f"{held.get('pid')}, started {held.get('start')}); wait for it or use another "
                        f"logging.out_dir (if that run is gone, delete {self.path})"
                    ) from None
                log(f"megasparse: taking over the stale lock {self.path} ({why})")
                self.path.unlink(missing_ok=True)
                continue
            except OSError as e:
                raise StorageError(os_error_line(self.path, e, "create the run lock")) from e
            with os.fdopen(fd, "w") as f:
                f.write(text)
            self.held = True
            self._thread = threading.Thread(target=self._beat, name="megasparse-lock", daemon=True)
            self._thread.start()
            return
        raise ConfigError(f"could not take the run lock {self.path}: another process keeps recreating it")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        if not self.held:
            return
        self._stop.set()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        self.held = False


def previous_run(out_dir: Path) -> list[str]:
    """What in ``out_dir`` belongs to an earlier run (checkpoints, non-empty metrics)."""
    found = []
    ck = out_dir / "checkpoints"
    if ck.is_dir() and any(p.name.startswith(("step-", ".tmp-step-")) for p in ck.iterdir()):
        found.append("checkpoints/")
    m = out_dir / "metrics.jsonl"
    if m.is_file() and m.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def refuse_or_move_previous(out_dir: Path, mode: str, log=print) -> None:
    """A fresh run never overwrites another run's files: one line naming the choices, or ``move_aside``."""
    found = previous_run(out_dir)
    if not found:
        return
    if mode != "move_aside":
        raise ConfigError(
            f"logging.out_dir={out_dir} already holds a run ({', '.join(found)}) and checkpoint.resume is not set; "
            "continue it with checkpoint.resume=auto, use another logging.out_dir, or set "
            "logging.previous_run=move_aside to move it into a previous-<time>/ folder (nothing is deleted)"
        )
    dst = out_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    dst.mkdir()
    for name in RUN_FILES:
        if (out_dir / name).exists():
            os.replace(out_dir / name, dst / name)
    log(f"megasparse: moved the previous run's {', '.join(found)} aside to {dst}")


def _probe_dir(path: Path, what: str) -> None:
    """Create ``path`` if needed and write + remove a probe file in it; StorageError with the OS's words."""
    if path.is_symlink() and not path.exists():
        raise StorageError(f"{what} {path} is a dangling symlink (to {os.readlink(path)})")
    if path.exists() and not path.is_dir():
        raise StorageError(f"{what} {path} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise StorageError(os_error_line(path, e, f"write to {what}")) from e


def check_storage(out_dir: Path, checkpoint_bytes: int, saving: bool) -> None:
    """At start (rank 0): out_dir and checkpoints/ writable, and free space for one more checkpoint."""
    _probe_dir(out_dir, "logging.out_dir")
    if not saving:
        return
    ck = out_dir / "checkpoints"
    _probe_dir(ck, "the checkpoint directory")
    free = shutil.disk_usage(ck).free
    if free < checkpoint_bytes:
        raise StorageError(
            f"not enough space for a checkpoint in {ck}: {free / 2**30:.2f} GiB free, one checkpoint needs about "
            f"{checkpoint_bytes / 2**30:.2f} GiB (weights and AdamW moments in fp32); free space or use another "
            "logging.out_dir"
        )


def storage_error(root: Path, tmp: Path, e: BaseException, fallback: str) -> StorageError:
    """One line for a failed save: the OS error when one is inside ``e`` (DCP wraps per-rank failures), else the
    OS error a 1 MiB probe write gets (torch's writer reports ENOSPC as "unexpected pos"), else ``e``'s line."""
    inner = [e]
    for v in (getattr(e, "failures", None) or {}).values():
        inner.append(v[0] if isinstance(v, tuple) else v)
    for x in list(inner):
        inner += [y for y in (x.__cause__, x.__context__) if y is not None]
    os_err = next((x for x in inner if isinstance(x, OSError) and x.errno), None)
    if os_err is None:
        probe = root / f".space-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as pe:
            os_err = pe
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    if os_err is not None:
        where = os_err.filename or tmp
        line = os_error_line(where, os_err, "write the checkpoint")
        return StorageError(f"{line}; the previous checkpoint is untouched")
    return StorageError(f"cannot write the checkpoint {tmp}: {fallback}; the previous checkpoint is untouched")
