"""How each micro-batch executes, and one step's forward + backward composed from the three parts.

An executor answers ``in_flight(batches, p2p, step, step_no)``: the handler the schedule runs each micro-batch's
forward and backward through this step, or None for the eager one (``pipeline.InFlight``). ``EagerExecutor``
always answers None; the CUDA-graph executor is ``cudagraph.CapturedSteps`` (captured once, replayed, eager with a
reason when a component blocks capture or the capture fails).

``ForwardBackward`` is what the trainer calls: ``MicrobatchStep`` (what runs), ``get_schedule`` (in which order)
and the executor (how), for a training step or an evaluation.
"""

from __future__ import annotations

import torch

from megasparse.data.batch import Batch
from megasparse.parallel import comm
from megasparse.parallel.pipeline import StageComm
from megasparse.step.microbatch import MicrobatchStep
from megasparse.step.schedule import get_schedule

__all__ = ["EagerExecutor", "ForwardBackward", "global_mean"]


class EagerExecutor:
    """Every micro-batch runs eagerly (no CUDA graphs: CPU runs, ``train.cuda_graphs=false``)."""

    blocker = "eager executor"
    active = False

    def in_flight(self, batches: list[Batch], p2p: StageComm, step: MicrobatchStep, step_no: int) -> None:
        return None

    def release(self) -> None:
        pass


class ForwardBackward:
    """One step's micro-batches on this rank: ``fb(batches, train, step_no)`` -> (summed per-token loss, tokens).

    Training runs the config's schedule (1F1B, interleaved or lock-step) with the executor's in-flight handler and
    leaves the gradients accumulated (reduction over DP is the optimizer's); evaluation runs forward-only."""

    def __init__(self, cfg, step: MicrobatchStep, p2p: StageComm, executor, device: torch.device):
        self.step, self.p2p, self.executor, self.device = step, p2p, executor, device
        self.train_schedule, self.eval_schedule = get_schedule(cfg, True), get_schedule(cfg, False)

    @classmethod
    def build(cls, cfg, model, parts, p2p: StageComm, executor, num_mb: int, dp: int, dp_rank: int, device):
        """The step of ``model`` (this rank's stage) with ``parts`` (``step/build.py``'s Components)."""
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        ms = MicrobatchStep(
            model,
            parts.filter,
            parts.vocab_pp,
            tokens_per_mb=tokens,
            num_mb=num_mb,
            dp=dp,
            dp_rank=dp_rank,
            eod=parts.eod,
            doc_kernel=parts.doc_kernel,
        )
        return cls(cfg, ms, p2p, executor, device)

    def __call__(self, batches: list[Batch], train: bool, step_no: int) -> tuple[torch.Tensor, int]:
        ms = self.step
        ms.begin(batches, train, step_no, self.device)
        if train:
            handler = self.executor.in_flight(batches, self.p2p, ms, step_no)
            self.train_schedule(len(batches), self.p2p, ms, handler, ms.slot())
        else:
            self.eval_schedule(len(batches), self.p2p, ms, None, ms.slot())
        ms.finish()
        return ms.loss_sum, ms.tokens_per_mb * len(batches)


def global_mean(loss_sum: torch.Tensor, tokens: int, last_stage: bool, device: torch.device) -> float:
    """Mean loss over every DP rank's tokens, known on every rank (sent from the last stage)."""
    t = torch.stack([loss_sum.double(), torch.tensor(float(tokens), dtype=torch.float64, device=device)])
    if not last_stage:
        t.zero_()
    with comm.phase("metrics"):
        comm.all_reduce(t, None, "world", region="metrics.loss")
    return (t[0] / t[1]).item()
