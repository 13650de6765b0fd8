"""Preemption: a signal saves a checkpoint at the next step boundary instead of killing the run.

SIGTERM (Slurm preemption, ``scancel``, torchrun shutting down), SIGINT (Ctrl-C) and ``checkpoint.signal``
(SIGUSR1 by default: what ``launch/slurm/train.sbatch`` asks Slurm to send before the time limit) only set a flag.
At the end of every step the ranks agree on it with one 1-element all-reduce (MAX over the world), because a
signal may reach only some ranks and every rank must take part in the save. The cost is one tiny collective and a
host read per step; the step already ends with a host read of the loss (and ``cuda.synchronize``), so this adds a
collective's latency (tens of microseconds on NVLink) and no new device sync point (docs/decisions/0903).

A signal during a save is only recorded: the save runs to its end (atomic rename included), then the run stops.
A second SIGINT outside a save raises KeyboardInterrupt (the usual double Ctrl-C).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from megasparse.configbase import ConfigError
from megasparse.parallel import comm

EXIT_PREEMPTED = 75
"""Exit status after a signal-triggered save (sysexits' EX_TEMPFAIL: stopped on purpose, relaunch to continue)."""


def signal_number(name: str | None, key: str = "checkpoint.signal") -> int | None:
    """``SIGUSR1`` / ``USR1`` / ``10`` as a signal number; None for none/off; one ConfigError line otherwise."""
    if name is None or str(name).lower() in ("", "none", "off", "false"):
        return None
    text = str(name).strip().upper()
    if text.isdigit():
        num = int(text)
    else:
        sig = getattr(signal, text if text.startswith("SIG") else "SIG" + text, None)
        num = int(sig) if isinstance(sig, signal.Signals) else -1
    if num not in {int(s) for s in signal.valid_signals()} or num in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"{key}={name} is not a signal this process can catch; use e.g. SIGUSR1, SIGUSR2 or none")
    return num


_signalled = False


def signalled() -> bool:
    """Whether a stop signal reached this process (a failure then needs no grace period before exiting)."""
    return _signalled


class Preempted(Exception):
    """The run stopped on a signal after saving (or trying to save); main() prints ``line`` and exits 75."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class Preemption:
    """Signal flag, installed for the training loop; ``agreed()`` at each step boundary."""

    def __init__(self, extra: str | None, device: torch.device):
        nums = [signal.SIGTERM, signal.SIGINT]
        extra_num = signal_number(extra)
        if extra_num is not None and extra_num not in nums:
            nums.append(extra_num)
        self.signals = nums
        self.device = device
        self.received: int | None = None
        self.saving = False
        self._old: dict[int, object] = {}
        self._flag: torch.Tensor | None = None

    def install(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handler(self, signum: int, frame) -> None:
        global _signalled
        _signalled = True
        if self.received is not None and signum == signal.SIGINT and not self.saving:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.received is None:
            self.received = signum

    def agreed(self) -> int | None:
        """The signal any rank received (the same answer on every rank), or None."""
        local = self.received or 0
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local or None
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        if self._flag is None or self._flag.device != dev:  # one buffer for the run: no allocation per step
            self._flag = torch.zeros(1, device=dev)
        flag = self._flag.fill_(float(local))
        with comm.phase("checkpoint"):
            comm.all_reduce(flag, None, "world", op=dist.ReduceOp.MAX, region="preempt.flag")
        got = int(flag.item())
        return got or None

    @staticmethod
    def name(signum: int) -> str:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"


_current: Preemption | None = None


def install(extra: str | None, device: torch.device | None = None) -> Preemption:
    """The process's handlers, installed once: main() calls this right after reading the config, so a signal that
    arrives while the model and data are built is kept, not fatal; the trainer's call adopts them."""
    global _current, _signalled
    if _current is None:
        _signalled = False
        _current = Preemption(extra, device or torch.device("cpu")).install()
    elif device is not None:
        _current.device = device
    return _current


def uninstall() -> None:
    """Restore the previous handlers (end of a run)."""
    global _current
    if _current is not None:
        _current.restore()
        _current = None
