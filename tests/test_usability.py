"""What a user types and reads: loss names (decision 0020), overrides anywhere on a command line, `megasparse plan`
without CUDA, `ref score --max-tokens`, and the start banner and per-step line (decision 0021)."""

from __future__ import annotations

import pytest

from megasparse.config import ConfigError, load_config
from megasparse.loss.config import LossConfig


@pytest.mark.parametrize(
    "override,fix",
    [("loss.impl=torch", "use loss.impl=materialized"), ("loss.backend=torch", "use loss.backend=reference")],
)
def test_old_loss_names_fail_with_the_new_one(override, fix):
    with pytest.raises(ConfigError, match=fix) as e:
        load_config(None, [override])
    assert "renamed" in str(e.value) and "\n" not in str(e.value)


def test_loss_built_in_code_with_an_old_name_fails_validation():
    with pytest.raises(ConfigError, match="use loss.impl=materialized"):
        LossConfig(impl="torch").validate()
    with pytest.raises(ConfigError, match="use loss.backend=reference"):
        LossConfig(backend="torch").validate()


def test_each_loss_choice_has_one_name():
    cfg = load_config(None, ["loss.impl=materialized", "loss.backend=reference"])
    cfg.loss.validate()
    assert (cfg.loss.impl, cfg.loss.backend) == ("materialized", "reference")
    assert cfg.loss.resolved_impl(8192, 64128) == "materialized"
    assert load_config(None, []).loss.resolved_impl(8192, 64128) == "materialized"  # auto, under the budget
