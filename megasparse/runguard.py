"""The trainer's operational guard rails, called from ``Trainer.fit`` at a few points (issue 32).

``RunGuard.start`` (before anything in out_dir changes): rank 0 takes the out_dir lock, probes the storage and its
free space, refuses a fresh run over another run's files; every rank learns the verdict through one all-reduce so
all of them stop together with rank 0's one line. ``check_resume`` compares the checkpoint's recorded data-order /
optimisation settings with this run's. ``boundary`` (end of every step) turns an agreed signal into a save and
``Preempted``. ``failure_line`` / ``report_failure`` turn an unexpected exception into one line naming the rank and
what it was doing, with the real error printed last (docs/reliability.md, docs/decisions/0903-0905).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from megasparse import preempt, rundir
from megasparse.configbase import ConfigError, to_dict
from megasparse.parallel import comm, state
from megasparse.preempt import EXIT_PREEMPTED, Preempted

_doing = "starting"

RESUME_KEYS = ("data.", "filter.", "optim.", "model.seq_length", "train.global_batch_size", "train.seed")
"""What a resume may not change silently: the data order (data set, split, seed, sequence length, global batch),
the token selection and the optimiser. ``train.steps`` is left out: extending a finished run is the common case
(its cosine schedule then stretches, as documented). ``data.cache_dir`` only says where files are."""
_IGNORED = ("data.cache_dir",)


def doing(what: str) -> None:
    """Record what this rank is doing now (named in a failure line)."""
    global _doing
    _doing = what


def in_loop() -> bool:
    """Whether this rank is inside the training loop (an error there may be this rank's alone)."""
    return _doing.startswith("training step")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def run_record(cfg) -> dict:
    """The settings a resume compares against (saved in every checkpoint's layout.json)."""
    flat = flatten(to_dict(cfg))
    return {k: v for k, v in flat.items() if k.startswith(RESUME_KEYS) and k not in _IGNORED}


def resume_differences(saved: dict, now: dict) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _any(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any (one 1-element all-reduce; free at world size 1)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1.0 if flag else 0.0], device=dev)
    with comm.phase("checkpoint"):
        comm.all_reduce(t, None, "world", op=dist.ReduceOp.MAX, region="runguard.verdict")
    return bool(t.item())


def agree(check, device: torch.device) -> None:
    """Run ``check`` on rank 0; if it raises a ConfigError every rank raises (rank 0's line is the one printed)."""
    err = None
    if _rank0():
        try:
            check()
        except ConfigError as e:
            err = e
    if _any(err is not None, device):
        raise err if err is not None else ConfigError("rank 0 refused to start (its line says why)")


def checkpoint_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """About one checkpoint's size: every parameter once (DP rank 0's copies, summed over the world) in fp32 with
    two fp32 AdamW moments."""
    lay = state.layout()
    local = 0 if lay.dp_rank else sum(p.numel() for p in model.parameters()) * 12
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([float(local)], device=dev, dtype=torch.float64)
        with comm.phase("checkpoint"):
            comm.all_reduce(t, None, "world", region="runguard.size")
        return int(t.item())
    return local


class RunGuard:
    """Lock, start checks, resume checks and preemption for one ``Trainer.fit``."""

    def __init__(self, cfg, device: torch.device, log=print):
        doing("starting")
        self.cfg = cfg
        self.device = device
        self.log = log
        self.out_dir = Path(cfg.logging.out_dir)
        self.lock = rundir.RunLock(self.out_dir)
        self.preempt = preempt.install(cfg.checkpoint.signal, device)

    # -- start --------------------------------------------------------------------------------------------
    def start(self, model: torch.nn.Module, resume: str | None) -> None:
        """Before the first change to out_dir: lock, storage, previous run; warnings for odd-but-legal settings."""
        cfg = self.cfg
        with contextlib.suppress(AttributeError, ValueError):  # RLIMIT_FSIZE: a write past it fails with EFBIG
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # instead of killing the process without a word
        size = checkpoint_bytes(model, self.device)
        saving = bool(cfg.checkpoint.save_interval or cfg.checkpoint.save_at_end)

        def check() -> None:
            rundir.check_storage(self.out_dir, size, saving)
            self.lock.acquire(self.log)
            if resume is None and cfg.checkpoint.resume is None:
                rundir.refuse_or_move_previous(self.out_dir, cfg.logging.previous_run, self.log)

        try:
            agree(check, self.device)
        except ConfigError:
            self.lock.release()
            raise
        if _rank0():
            for line in warnings(cfg):
                print(f"megasparse: warning: {line}", file=sys.stderr, flush=True)
        sig = self.preempt.agreed()
        if sig is not None:  # a signal while the model and data were built: nothing new to save
            raise Preempted(
                f"stopped by {self.preempt.name(sig)} before the first step of this run: nothing new to save; "
                f"relaunch with checkpoint.resume=auto to continue (exit status {EXIT_PREEMPTED})"
            )

    def check_resume(self, where: Path, step: int) -> None:
        """One line listing what changed since ``where`` was saved (refused unless checkpoint.accept_changes);
        one line when train.steps leaves nothing to run: an error for an explicit checkpoint.resume, a note (exit 0)
        under resume=auto, where it is a requeue or restart of a run that already finished."""
        f = Path(where) / "layout.json"
        saved = json.loads(f.read_text()).get("run") if f.exists() else None
        if saved is not None:
            diffs = resume_differences(saved, run_record(self.cfg))
            if diffs and not self.cfg.checkpoint.accept_changes:
                raise ConfigError(
                    f"resuming {where} would change the data order or the optimisation: {'; '.join(diffs)}; "
                    "resume with the saved values, or set checkpoint.accept_changes=true to continue anyway"
                )
            if diffs:
                self.log(f"checkpoint.accept_changes=true: continuing {Path(where).name} with {'; '.join(diffs)}")
        if step >= self.cfg.train.steps and self.cfg.checkpoint.resume == "auto":  # a relaunch of a finished run
            self.log(f"checkpoint.resume=auto: {where} is already at step {step} >= train.steps={self.cfg.train.steps}:"
                     " nothing to run; raise train.steps to continue this run")  # fmt: skip
        elif step >= self.cfg.train.steps:
            raise ConfigError(
                f"train.steps={self.cfg.train.steps} but {where} is already at step {step}: nothing to run; "
                f"raise train.steps above {step} to continue this run"
            )

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        doing(f"training step {step + 1}")

    @contextlib.contextmanager
    def saving(self, step: int):
        """A save: a signal meanwhile is only recorded, and the save finishes."""
        doing(f"saving the checkpoint of step {step}")
        self.preempt.saving = True
        try:
            yield
        finally:
            self.preempt.saving = False

    def boundary(self, step: int, saved_now: bool, save) -> None:
        """End of a step: if any rank got a signal, save (unless this step just did) and raise Preempted."""
        doing(f"agreeing on a stop signal after step {step}")
        sig = self.preempt.agreed()
        if sig is None:
            return
        name = self.preempt.name(sig)
        where = None
        if not saved_now:
            with self.saving(step):
                where = save()
            what = f"saved {where}" if where else "state is non-finite, nothing saved"
        else:
            what = "its checkpoint was just saved"
        raise Preempted(
            f"stopped by {name} after step {step}: {what}; relaunch with checkpoint.resume=auto to continue "
            f"(exit status {EXIT_PREEMPTED})"
        )

    def close(self) -> None:
        preempt.uninstall()
        self.lock.release()


def warnings(cfg) -> list[str]:
    """Legal settings that are almost always a mistake: one line each, the run goes on."""
    out = []
    if cfg.data.ref_losses and cfg.filter.mode == "off":
        out.append("data.ref_losses is set but filter.mode=off: the reference losses are not read")
    if cfg.optim.warmup_steps >= cfg.train.steps:
        out.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} >= train.steps={cfg.train.steps}: the learning rate never "
            f"reaches optim.lr={cfg.optim.lr}"
        )
    return out


# -- failures -----------------------------------------------------------------------------------------------
PEER_GRACE_S = 10.0
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused", "peer", "socket closed")
_TIMEOUT = ("timed out", "timeout", "watchdog")


OOM_LEVERS = (
    "lower train.micro_batch_size, set model.recompute=selective (or full), parallel.distributed_optimizer=true, "
    "or split the model over more stages (megasparse plan CONFIG estimates each stage's memory)"
)
"""What an out-of-memory failure line suggests: the keys that trade speed for memory, most to least cheap."""


def classify(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "oom"
    text = f"{type(e).__name__}: {e}".lower()
    if any(s in text for s in _TIMEOUT):
        return "timeout"
    if any(s in text for s in _PEER_GONE):
        return "peer"
    return "own"


def failure_line(e: BaseException, rank: int, timeout_s: float | None = None) -> str:
    """One line: which rank, what it was doing, what happened (the error's first line)."""
    msg = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:300]
    if isinstance(e, ConfigError):
        return f"rank {rank} stopped while {_doing}: {msg}"
    kind = classify(e)
    if kind == "timeout":
        after = f" after {timeout_s:g} s (parallel.timeout_minutes)" if timeout_s else ""
        return (f"rank {rank} timed out{after} while {_doing}: another rank never joined the collective (hung, "
                f"dead or elsewhere in the program) [{type(e).__name__}: {msg}]")  # fmt: skip
    if kind == "peer":
        return (f"rank {rank} lost a peer while {_doing}: another rank failed or was killed; its error is the "
                f"real one [{type(e).__name__}: {msg}]")  # fmt: skip
    if kind == "oom":
        return f"rank {rank} ran out of GPU memory while {_doing} [{msg}]: {OOM_LEVERS}"
    return f"rank {rank} failed while {_doing}: {type(e).__name__}: {msg}"


def report_failure(e: BaseException, timeout_s: float | None, received_signal: bool, status: int = 1) -> int:
    """Print an unexpected failure so that the real error comes last; returns the exit status.

    The rank with its own error prints its traceback (a bug) and its line at once. A rank that only lost its peer
    (gloo's "Connection closed by peer") waits ``PEER_GRACE_S`` before printing: under torchrun the agent stops it
    in that time, so the failed rank's error stays the last line and torchrun's "Root Cause" names that rank. A
    peer that already got a stop signal (the launcher is tearing the job down: the failed rank has exited and
    printed) prints nothing; a timed-out rank prints at once.
    """
    rank = state.world_env()[0]
    kind = "own" if isinstance(e, ConfigError) else classify(e)
    line = f"megasparse: error: {failure_line(e, rank, timeout_s)}"
    if kind == "own" and not isinstance(e, ConfigError):  # a bug: the traceback, then the line
        traceback.print_exception(e, file=sys.stderr)
    if kind == "peer":
        if received_signal:  # the launcher is stopping the job after the failed rank exited: that rank spoke
            return status
        preempt.uninstall()  # the launcher's SIGTERM during the wait ends this process, as it should
        time.sleep(PEER_GRACE_S)
    print(line, file=sys.stderr, flush=True)
    return status


def run_main(load, train) -> int:
    """``megasparse train``'s exit status around ``train(load())``: 0; 75 with one line after a signal-triggered save;
    2 with one ConfigError line, printed once by rank 0 without a traceback for torchrun to bury it under (or by
    the one rank that raised it inside the loop, e.g. a broken sidecar); 1 for a failed or timed-out rank, named
    in one line with the real error last (``report_failure``)."""
    from megasparse.guard import DivergedError

    cfg = None
    try:
        cfg = load()
        preempt.install(cfg.checkpoint.signal)  # from here a stop signal is kept for the step boundary
        train(cfg)
    except Preempted as e:
        if state.world_env()[0] == 0:
            print(f"megasparse: {e.line}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except ConfigError as e:
        if in_loop() and not isinstance(e, DivergedError):  # this rank's alone; divergence is every rank's
            return report_failure(e, None, preempt.signalled(), status=2)
        if state.world_env()[0] == 0:
            print(f"megasparse: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # noqa: BLE001 - a failed or timed-out rank: one line naming it, the real error last
        timeout_s = cfg.parallel.timeout_minutes * 60 if cfg is not None else None
        return report_failure(e, timeout_s, preempt.signalled())
    finally:
        preempt.uninstall()
        if dist.is_initialized():
            state.destroy()
    return 0
