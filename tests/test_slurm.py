"""A real one-node Slurm (Debian's slurm-wlm: munged, slurmctld, slurmd on localhost) runs
launch/slurm/train.sbatch on a CPU config: the time-limit warning signal (USR1 to the batch shell, what
``--signal=B:USR1@120`` sends) goes through srun and torchrun to both workers, they save, the script requeues the
job, and the requeued job resumes from that checkpoint and finishes. Skipped, with the reason, where Slurm is not
installed or cannot start. Every query of the controller
treats no answer as "unknown", never as "finished": under a loaded CI machine squeue can time out. The requeued
attempt waits out Slurm's requeue delay (``cred_expire``, 10 s here): skipping it once made slurmd refuse the launch
("Job credential revoked"), so the attempt ended without running a line of the script (three CI runs). The script's
first line names the attempt (``attempt 2``); a failure carries slurmctld's and slurmd's lines on the job."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import free_port

REPO = Path(__file__).resolve().parents[1]
CRED_EXPIRE = 10
"""slurm.conf's AuthInfo cred_expire (s): how long slurmd refuses a requeued job's relaunch (default 120)."""
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol")
TINY = """data: {prefix: synthetic}
model: {vocab_size: 64, seq_length: 8, hidden_size: 16, num_attention_heads: 2, num_layers: 2}
train: {micro_batch_size: 2, global_batch_size: 4, device: cpu, dtype: fp32, eval_interval: 0, steps: STEPS}
parallel: {backend: gloo}
checkpoint: {resume: auto}
logging: {log_interval: 1000}
"""


def _wait(cond, limit: float, what: str, poll: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < limit:
        got = cond()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {limit} s waiting for {what}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if missing:
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing)}; apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("slurmd needs root to start job steps")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(
        f"""ClusterName=megatest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock,cred_expire={CRED_EXPIRE}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    sbin = lambda t: shutil.which(t) or f"/usr/sbin/{t}"  # noqa: E731
    daemons = [
        subprocess.Popen([sbin("munged"), "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={key}",
                          f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
    ]  # fmt: skip
    try:
        _wait(lambda: (d / "munge.sock").exists(), 20, "munged's socket")
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            log = open(d / f"{daemon[0]}.out", "w")  # noqa: SIM115
            daemons.append(subprocess.Popen([sbin(daemon[0]), *daemon[1:], "-f", str(conf)], env=env, stdout=log,
                                            stderr=subprocess.STDOUT))  # fmt: skip

        try:
            _wait(lambda: _node_state(env) == "idle", 30, "an idle node")
        except AssertionError:
            logs = "".join((d / n).read_text()[-1500:] for n in ("slurmctld.out", "slurmd.out") if (d / n).exists())
            pytest.skip(f"Slurm did not start here: {logs.strip().splitlines()[-1:] or 'no log'}")
        yield env, d
    finally:
        for p in reversed(daemons):
            p.terminate()
        for p in reversed(daemons):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _job(env, job: str) -> tuple[str, str]:
    """The job's state and restart count from slurmctld; ("?", "") when it did not answer (a busy controller on a
    loaded 2-core machine times out), so that no wait takes a failed query for a finished job."""
    r = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True)
    if r.returncode != 0 or "JobState=" not in r.stdout:
        return "?", ""
    fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
    return fields.get("JobState", "?"), fields.get("Restarts", "")


def _node_state(env) -> str:
    """The one node's state as sinfo prints it (idle, alloc, comp, ...); "?" when the controller did not answer."""
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "?"


def _slurm_logs(d: Path, job: str) -> str:
    """What slurmctld and slurmd said about ``job`` (the last lines naming it), for a failure message."""
    lines = []
    for name in ("slurmctld.log", "slurmd.log"):
        f = d / name
        if f.exists():
            lines += [f"{name}: {ln}" for ln in f.read_text(errors="replace").splitlines() if f"JobId={job}" in ln
                      or f"job {job}" in ln.lower() or f"StepId={job}" in ln][-12:]  # fmt: skip
    return " | ".join(lines) or "no log lines"


@pytest.mark.slow
def test_sbatch_warning_signal_saves_requeues_and_finishes(slurm, tmp_path):
    env, _ = slurm
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.replace("STEPS", "100000"))
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    job_env = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "PYTHONPATH": str(REPO),
               "GPUS_PER_NODE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    r = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "--nodes=1", "--cpus-per-task=1", "--gpus-per-node=0",
         "--open-mode=append", f"--output={log}", "launch/slurm/train.sbatch", str(cfg), f"logging.out_dir={out}"],
        cwd=REPO, env=job_env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    metrics = out / "metrics.jsonl"
    _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 240, "the first steps")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)  # = --signal=B:USR1@T
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731
    _wait(lambda: "requeueing job" in text() or "requeue failed" in text(), 120, "the save and the requeue")
    stopped = [ln for ln in text().splitlines() if "megasparse: stopped by SIGUSR1 after step" in ln]
    assert len(stopped) == 1, text()[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert f"requeueing job {job}" in text(), text()[-3000:]
    assert f"train.sbatch: job {job} attempt 1 on 1 node(s)" in text(), text()[-3000:]
    cfg.write_text(TINY.replace("STEPS", str(step + 3)))  # the requeued attempt reads the config when it starts
    # Slurm holds a requeued job for cred_expire + 1 s, until slurmd has forgotten the first attempt's revoked
    # credential: StartTime=now at once got "Job credential revoked" and a launch that never ran the script (3 CI
    # runs, 1 in 6 here). After that the scheduler may still wait for its next pass (~60 s): StartTime=now then
    _wait(lambda: _job(env, job) == ("PENDING", "1"), 60, "the requeued job")
    time.sleep(CRED_EXPIRE + 2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    _wait(lambda: _job(env, job)[0] in done, 240, "the requeued job to finish", poll=1)
    assert f"train.sbatch: job {job} attempt 2 " in text(), f"{_job(env, job)}: {_slurm_logs(slurm[1], job)}"
    assert f"resumed from {out / 'checkpoints' / f'step-{step}'} at step {step}" in text(), text()[-3000:]
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert steps == list(range(1, step + 4))
    info = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    assert "Restarts=1" in info and "JobState=COMPLETED" in info, info
