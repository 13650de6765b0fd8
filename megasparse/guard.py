"""The non-finite guard: a step whose loss or global gradient norm is NaN/inf is skipped, not applied.

Both numbers are already global when the guard looks at them (the loss is all-reduced over the world, the
gradient norm over the model-parallel group after the DP reduction), so every rank takes the same decision
without an extra collective. The check runs before ``optimizer.step`` so a skipped step leaves weights and
AdamW moments untouched; ``max_skipped`` consecutive skips end the run (the loss has diverged, not spiked).
"""

from __future__ import annotations

import math

from megasparse.configbase import ConfigError


class DivergedError(ConfigError):
    """Too many consecutive non-finite steps: the run stops with one line and exit code 2."""


class NonFiniteGuard:
    """Counts skipped steps; ``check`` says whether this step must be skipped."""

    def __init__(self, max_skipped: int):
        self.max_skipped = max_skipped
        self.consecutive = 0
        self.total = 0

    def check(self, step: int, loss: float, grad_norm: float, log=print) -> bool:
        """True when the step must be skipped; raises DivergedError after ``max_skipped`` in a row."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total += 1
        log(
            f"step {step}: non-finite loss {loss} / grad norm {grad_norm}: update skipped "
            f"({self.consecutive} in a row, {self.total} in total)"
        )
        if self.consecutive >= self.max_skipped:
            raise DivergedError(
                f"{self.consecutive} consecutive steps had a non-finite loss or gradient norm (last: step {step}); "
                "stopping (train.max_skipped_steps); lower optim.lr or resume from an earlier checkpoint"
            )
        return True
