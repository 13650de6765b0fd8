"""Launch scripts: the commands their dry runs print are what torchrun would accept and what we meant."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"


def _torchrun_args(argv: list[str]):
    """Parse a printed torchrun command line with torch's own parser (whatever launcher spelling it uses)."""
    from torch.distributed.run import get_args_parser

    i = argv.index("--nnodes") if "--standalone" not in argv else argv.index("--standalone")
    return get_args_parser().parse_args(argv[i:])


def _run(script: Path, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=30)


@pytest.fixture
def config(tmp_path) -> Path:
    cfg = tmp_path / "toy.yaml"
    cfg.write_text("train:\n  steps: 2\n")
    return cfg


def test_torchrun_dry_run(tmp_path, config):
    env = {**os.environ, "DRY_RUN": "1"}
    env.pop("OMP_NUM_THREADS", None)
    res = _run(TORCHRUN_SH, ["4", str(config), "parallel.tp=2", "logging.out_dir=runs/a b"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    argv = shlex.split(lines[0])
    args = _torchrun_args(argv)
    assert args.standalone and args.nnodes == "1" and args.nproc_per_node == "4"
    assert args.module and args.training_script == "megasparse"
    assert args.training_script_args == ["train", str(config), "parallel.tp=2", "logging.out_dir=runs/a b"]

    env["TORCHRUN"] = "/opt/py/bin/python -m torch.distributed.run"
    argv = shlex.split(_run(TORCHRUN_SH, ["1", str(config)], env, tmp_path).stdout)
    assert argv[:3] == ["/opt/py/bin/python", "-m", "torch.distributed.run"]
    assert _torchrun_args(argv).nproc_per_node == "1"


@pytest.mark.parametrize(
    "args, message",
    [(["2"], "usage"), (["two", "CFG"], "positive integer"), (["2", "missing.yaml"], "does not exist")],
)
def test_torchrun_bad_arguments(tmp_path, config, args, message):
    args = [str(config) if a == "CFG" else a for a in args]
    res = _run(TORCHRUN_SH, args, {**os.environ, "DRY_RUN": "1"}, tmp_path)
    assert res.returncode == 2 and message in res.stderr and res.stdout == ""


@pytest.fixture
def fake_slurm(tmp_path) -> dict[str, str]:
    """A fake ``scontrol`` on PATH that expands the node list like Slurm and logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        "#!/bin/bash\n"
        f'echo "$@" >> {tmp_path}/scontrol.log\n'
        '[[ $1 == show && $2 == hostnames && $3 == "gpu-[007-009]" ]] || exit 1\n'
        "printf 'gpu-007\\ngpu-008\\ngpu-009\\n'\n"
    )
    scontrol.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "MASTER_PORT"}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_NNODES="3",
        SLURM_JOB_NODELIST="gpu-[007-009]",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_ON_NODE="8",
        SLURM_SUBMIT_DIR=str(tmp_path),
        DRY_RUN="1",
    )
    return env


def test_slurm_dry_run_prints_one_torchrun_per_node(tmp_path, config, fake_slurm):
    res = _run(SBATCH, [config.name, "train.steps=5"], fake_slurm, REPO)  # relative to SLURM_SUBMIT_DIR
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == ["[gpu-007]", "[gpu-008]", "[gpu-009]"]
    commands = {ln.split(" ", 1)[1] for ln in lines}
    assert len(commands) == 1  # c10d rendezvous: every node runs the identical command
    argv = shlex.split(commands.pop())
    assert argv[0] == "torchrun"
    args = _torchrun_args(argv)
    assert (args.nnodes, args.nproc_per_node) == ("3", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "gpu-007:29500", "4242")
    assert args.module and args.training_script == "megasparse"
    assert args.training_script_args == ["train", config.name, "train.steps=5"]
    assert "show hostnames gpu-[007-009]" in (tmp_path / "scontrol.log").read_text()

    fake_slurm.update(GPUS_PER_NODE="4", MASTER_PORT="31000")
    args = _torchrun_args(
        shlex.split(_run(SBATCH, [config.name], fake_slurm, REPO).stdout.splitlines()[0].split(" ", 1)[1])
    )
    assert args.nproc_per_node == "4" and args.rdzv_endpoint == "gpu-007:31000"


def test_slurm_script_header_and_guards(tmp_path, config, fake_slurm):
    text = SBATCH.read_text()
    header = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in header and any("--nodes=" in h for h in header)
    assert "export NCCL_NVLS_ENABLE=0" in text and "srun" in text
    outside = {k: v for k, v in fake_slurm.items() if k not in ("SLURM_NNODES", "DRY_RUN")}
    res = _run(SBATCH, [config.name], outside, tmp_path)
    assert res.returncode == 2 and "not inside a Slurm allocation" in res.stderr
    res = _run(SBATCH, ["nope.yaml"], fake_slurm, tmp_path)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_slurm_dry_run_outside_allocation(tmp_path, config):
    """README's `DRY_RUN=1 bash launch/slurm/train.sbatch ...` previews one node's command without Slurm."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", SLURM_SUBMIT_DIR=str(tmp_path))
    res = _run(SBATCH, [config.name, "train.steps=3"], env, REPO)
    assert res.returncode == 0, res.stderr
    assert "outside a Slurm allocation" in res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    args = _torchrun_args(shlex.split(lines[0].split(" ", 1)[1]))
    assert args.nnodes == "1" and args.training_script_args == ["train", config.name, "train.steps=3"]
