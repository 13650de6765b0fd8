"""Parallel layout config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megasparse.configbase import ConfigError


@dataclass
class ParallelConfig:
    """How the world is split: world = tp × pp × dp (dp is derived)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    sequence_parallel: bool = False
    """Shard norms/residuals over the sequence in TP regions (needs tp > 1)."""
    layer_split: list[int] | None = None
    """Layers per pipeline stage, e.g. [3, 5]; None splits evenly (remainder to the first stages)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo."""
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
        if self.layer_split is not None:
            if len(self.layer_split) != self.pp or sum(self.layer_split) != num_layers:
                raise ConfigError(
                    f"parallel.layer_split={self.layer_split} must have {self.pp} entries summing to "
                    f"model.num_layers={num_layers}"
                )
            if min(self.layer_split) < 1:
                raise ConfigError(f"parallel.layer_split={self.layer_split}: every stage needs a layer")
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

    def stage_layers(self, num_layers: int) -> list[int]:
        """Number of layers on each pipeline stage."""
        if self.layer_split is not None:
            return list(self.layer_split)
        base, rem = divmod(num_layers, self.pp)
        return [base + (1 if i < rem else 0) for i in range(self.pp)]
