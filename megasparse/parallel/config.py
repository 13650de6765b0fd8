"""Parallel layout config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megasparse.configbase import ConfigError

AUTO = "auto"
"""``parallel.layer_split: auto``: the planner's split, resolved once when the model is built (decision 1243)."""


@dataclass(frozen=True)
class AutoSplit:
    """What ``layer_split: auto`` resolved to (``planner.resolve_layer_split``), for the banner and ``megasparse
    plan``: the planner's split against the even one, with its estimated step and memory change."""

    split: list[int]
    even: list[int]
    gain: float
    """Estimated share of the pipeline step saved against the even split (0: the even split is the best)."""
    more_gib: float
    """Estimated change of the fullest stage's memory against the even split."""
    peak_gib: float = 0.0
    """The planner's estimate of the fullest stage's memory on this split (``megasparse plan``'s total GiB)."""

    def describe(self) -> str:
        if self.split == self.even:
            return "the even split is already the planner's best"
        return (
            f"est. {100 * self.gain:.1f}% shorter step than {self.even}, {self.more_gib:+.1f} GiB on the fullest stage"
        )


@dataclass
class ParallelConfig:
    """How the world is split: world = tp × pp × dp (dp is derived)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    sequence_parallel: bool = False
    """Shard norms/residuals over the sequence in TP regions (needs tp > 1)."""
    layer_split: list[int] | Literal["auto"] | None = None
    """Layers per pipeline stage, e.g. [3, 5]; None splits evenly (remainder to the first stages). With
    virtual_stages > 1: layers per virtual stage, pp·virtual_stages entries in virtual-stage order (chunk c of
    rank r is entry c·pp + r). auto: the planner's split (``megasparse plan``: the last stage's output layer and
    loss weigh like blocks at a large vocabulary), replaced by the list when the model is built, so saved configs
    record it; 1F1B stages only (virtual_stages=1), not with chunkflow. Opt-in: the first stage's memory grows
    (docs/decisions/1243)."""
    auto_split: ClassVar[AutoSplit | None] = None
    """Not a config key: set on the instance when ``layer_split: auto`` was resolved (what the banner prints)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (Megatron's interleaved 1F1B): chunk c of rank r holds virtual stage
    c·pp + r. The bubble falls from (pp−1)/(M+pp−1) to (pp−1)/(v·M+pp−1) of a step for v times the pipeline
    transfers; needs pp > 1 and micro-batches per step a multiple of pp (docs/decisions/0802)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto (gloo when train.device=cpu or no CUDA, else nccl), nccl or gloo."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and AdamW moments over DP (each rank steps 1/dp of every gradient bucket, then the
    parameters are all-gathered; on GPU they become bf16 compute copies): optimizer memory per rank / dp.
    Off by default, as in Megatron: on one DP rank it saves nothing, and saves gather the whole state
    (docs/decisions/0404)."""
    overlap_grad_reduce: bool = True
    """Reduce each gradient bucket over DP as soon as its last gradient of the step exists, overlapping the rest of
    the backward (and, with the distributed optimizer, wait for gathered parameters at their first use in the next
    forward); off: the same buckets after the backward. Only matters when dp > 1."""
    grad_bucket_numel: int = 40_000_000
    """Parameters per DP gradient bucket (one collective each; Megatron's default size)."""
    timeout_minutes: float = 10.0
    """How long any collective may wait for the other ranks before the job fails with one line naming the rank
    (the default group and every megatron-core TP/PP/DP group alike)."""

    @property
    def sp_shards(self) -> int:
        """Shards of the sequence inside a TP region: tp under sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    def validate(self, world_size: int, num_layers: int, seq_length: int) -> int:
        """Check the layout against the world size; return dp."""
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"parallel.tp and parallel.pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {world_size} does not factor into parallel.tp={self.tp} x parallel.pp={self.pp}"
                f" x dp; launch a multiple of {self.tp * self.pp} ranks or change tp/pp"
            )
        if self.pp > num_layers:
            raise ConfigError(
                f"parallel.pp={self.pp} is more pipeline stages than model.num_layers={num_layers}; lower parallel.pp"
            )
        if self.layer_split == AUTO and self.pp == 1:
            raise ConfigError("parallel.layer_split=auto needs parallel.pp > 1 (one stage has nothing to split)")
        if self.layer_split == AUTO and self.virtual_stages > 1:
            raise ConfigError(
                f"parallel.layer_split=auto: the planner models plain 1F1B stages, not parallel.virtual_stages="
                f"{self.virtual_stages}; give parallel.layer_split per virtual stage (a list) or set virtual_stages=1"
            )
        self._validate_virtual(num_layers)
        stages = self.pp * self.virtual_stages
        if isinstance(self.layer_split, list):
            if len(self.layer_split) != stages or sum(self.layer_split) != num_layers:
                per = "" if self.virtual_stages == 1 else " (pp x virtual_stages, one per virtual stage)"
                raise ConfigError(
                    f"parallel.layer_split={self.layer_split} must have {stages} entries{per} summing to "
                    f"model.num_layers={num_layers}"
                )
            if min(self.layer_split) < 1:
                raise ConfigError(f"parallel.layer_split={self.layer_split}: every stage needs a layer")
        if not self.timeout_minutes > 0:
            raise ConfigError(f"parallel.timeout_minutes={self.timeout_minutes} must be > 0 (default 10)")
        if self.grad_bucket_numel < 1:
            raise ConfigError(f"parallel.grad_bucket_numel={self.grad_bucket_numel} must be >= 1 (default 40000000)")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if self.sequence_parallel and seq_length % self.tp:
            raise ConfigError(
                f"model.seq_length={seq_length} is not divisible by parallel.tp={self.tp} "
                "(sequence parallelism shards the sequence)"
            )
        return world_size // (self.tp * self.pp)

    def _validate_virtual(self, num_layers: int) -> None:
        v = self.virtual_stages
        if v < 1:
            raise ConfigError(f"parallel.virtual_stages={v} must be >= 1 (1: plain 1F1B)")
        if v > 1 and self.pp == 1:
            raise ConfigError(f"parallel.virtual_stages={v} needs parallel.pp > 1 (chunks interleave over stages)")
        if v > 1 and self.layer_split is None and num_layers % (self.pp * v):
            raise ConfigError(
                f"model.num_layers={num_layers} is not divisible by parallel.pp x parallel.virtual_stages="
                f"{self.pp * v}; change them or give parallel.layer_split per virtual stage"
            )

    def stage_layers(self, num_layers: int) -> list[int]:
        """Number of layers on each pipeline stage (each virtual stage, in virtual-stage order, when v > 1)."""
        if self.layer_split == AUTO:
            raise RuntimeError("parallel.layer_split=auto is resolved by planner.resolve_layer_split before use")
        if self.layer_split is not None:
            return list(self.layer_split)
        stages = self.pp * self.virtual_stages
        base, rem = divmod(num_layers, stages)
        return [base + (1 if i < rem else 0) for i in range(stages)]
