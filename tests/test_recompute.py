"""Activation recompute (``model.recompute``, decision 0012): the same loss and gradients, less saved.

none / selective / full give bitwise the same gradients with Collider's compact backward on (and never densify it),
at tp=1, at tp=2 + SP and at pp=2 over gloo; selective and full save less than none.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from test_filtered_backward import grads_of

MODES = ("none", "selective", "full")
COLLIDER = ["filter.mode=collider", "filter.keep_ratio=0.6"]


def _all_modes(overrides: list[str]) -> dict:
    """Every mode's gradients in this process, the densified count of each run and the recomputes taken."""
    from megasparse.ops import recompute

    rebuilt = []
    value = recompute._Rebuild.value

    def counted(self):
        rebuilt.append(1)
        return value(self)

    recompute._Rebuild.value = counted
    try:
        out = {m: grads_of(overrides + [f"model.recompute={m}"]) for m in MODES}
    finally:
        recompute._Rebuild.value = value
    out["rebuilt"] = len(rebuilt)
    return out


def _assert_same(res: dict) -> None:
    ref = res["none"]["grads"]
    for m in MODES:
        assert res[m]["densified"] == 0, m
        assert set(res[m]["grads"]) == set(ref)
        for k, g in res[m]["grads"].items():
            assert torch.equal(g, ref[k]), (m, k, (g - ref[k]).abs().max().item())
    assert res["rebuilt"] > 0  # selective's SwiGLU outputs were rebuilt, not saved


def test_recompute_modes_same_gradients_compact_backward():
    _assert_same(_all_modes(COLLIDER))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.pp=2"]])
def test_recompute_modes_same_gradients_gloo(layout):
    for res in run_distributed(_all_modes, 2, COLLIDER + layout):
        _assert_same(res)


def _saved_bytes(mode: str) -> int:
    """Bytes of activations one transformer layer's forward saves for its backward (parameters left out)."""
    from megasparse.model.config import ModelConfig
    from megasparse.model.gpt import TransformerBlock
    from megasparse.ops.attention import rope_tables
    from megasparse.parallel import state

    state.init(1, 1, False, "gloo")
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256, recompute=mode)
    block = TransformerBlock(cfg, 0, seed=0, device="cpu", sp=False, dtype=torch.float32, pg=state.groups())
    params = {p.data_ptr() for p in block.parameters()}
    cos, sin = rope_tables(32, cfg.head_dim, cfg.rope_theta, "cpu")
    x = torch.randn(32, 2, 64, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t is not x:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, cos, sin)
    y.sum().backward()  # the saved tensors (rebuilt ones included) still give a backward
    return sum(seen.values())


def test_recompute_saves_less():
    none, sel, full = (_saved_bytes(m) for m in MODES)
    ffn = 32 * 2 * 256 * 4  # the SwiGLU output fc2 no longer keeps
    assert sel <= none - ffn, (none, sel)
    assert full < sel, (sel, full)


def test_recompute_config_error():
    from megasparse.configbase import ConfigError
    from megasparse.model.config import ModelConfig

    with pytest.raises(ConfigError, match="model.recompute"):
        ModelConfig(recompute="some").validate()
