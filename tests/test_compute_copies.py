"""The bf16 weight copies made once per optimizer step (decision 0009) train exactly like a cast at every use, also
under an optimizer that writes the fp32 masters without moving their version counters (fused AdamW)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING, tiny

BF16 = tiny(**TRAINING, train__steps=6, train__dtype="bf16")
SPARSE = ["sparsity.enabled=true", "sparsity.refresh_interval=2", "sparsity.decay=1e-2"]


def _train(extra: list[str], copies: bool, fused: bool, steps: int = 4) -> dict:
    from megasparse.config import load_config
    from megasparse.optim import _decay_groups
    from megasparse.parallel.layers import _ParallelLinear
    from megasparse.sparse24.gemm import Sparse24Gemm
    from megasparse.train import Trainer

    tr = Trainer(load_config(None, BF16 + extra))
    linears = [m for m in tr.model.modules() if isinstance(m, _ParallelLinear)]
    outputs = [m for m in tr.model.modules() if getattr(m, "output_copy", None) is not None]
    if not copies:  # the per-use cast: what every layer did before
        tr.dp_opt.copies = None
        for m in linears:
            m.copy = None
        for m in outputs:
            m.output_copy = None
    if fused:  # moves no version counter: only the refresh after the step keeps the copies current
        o = tr.cfg.optim
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in _decay_groups(tr.model, o)]
        tr.dp_opt.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    losses, stale = [], 0
    for _ in range(steps):
        losses.append(tr.train_step().loss)
        for m in linears:  # what the next forward will multiply with (a sparse layer's copy is W ⊙ M itself)
            w = m.compute_weight()
            want = m.weight.detach()
            if isinstance(m.gemm, Sparse24Gemm) and m.gemm.manager.state(m.gemm.name) is not None:
                want = want * m.gemm.manager.masks[m.gemm.name]
            stale += int(w is not None and not torch.equal(w, want.to(torch.bfloat16)))
        for m in outputs if copies else []:
            stale += int(not torch.equal(m.output_copy.get(), m.output_weight.detach().to(torch.bfloat16)))
    kept = tr.dp_opt.copies.copies if tr.dp_opt.copies is not None else []
    return {"losses": losses, "stale": stale, "copies": len(kept), "linears": len(linears), "outputs": len(outputs)}


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("extra", [[], SPARSE], ids=["dense", "2:4"])
def test_copies_once_per_step_train_like_a_cast_per_use(extra, fused):
    res = run_distributed(_train, 1, extra, True, fused)[0]
    ref = run_distributed(_train, 1, extra, False, fused)[0]
    assert res["stale"] == 0
    # every linear and the output weight keep a copy; under 2:4 the FFN GEMMs keep their own (fc1, fc2 of each layer)
    assert res["outputs"] == 1
    assert res["copies"] == res["linears"] + 1 - (2 * 4 if extra else 0)
    assert res["losses"] == ref["losses"]  # the same bf16 operands: bitwise the same losses
    assert res["losses"][0] != res["losses"][-1]


def test_a_weight_written_in_place_is_copied_again():
    """A write outside the optimizer (a load, a test) moves the version: the next read copies before use."""
    from megasparse.parallel.layers import ComputeCopy

    w = torch.nn.Parameter(torch.randn(8, 4))
    c = ComputeCopy(w, torch.bfloat16)
    buf = c.get()
    with torch.no_grad():
        w.mul_(3.0)
    assert c.get() is buf  # the same buffer (a captured graph reads it) ...
    assert torch.equal(buf, (w.detach() * 1).to(torch.bfloat16))  # ... holding the new values


def _layer_grads(fuse: bool) -> dict:
    """Two backward passes through a column- and a row-parallel layer, the weight gradients summed by autograd
    (no ``main_grad``) or added by the layers into fp32 bucket slices (``main_grad``, as the trainer's buckets do)."""
    from megasparse.parallel import state
    from megasparse.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    state.init(1, 1, False, "gloo")
    kw = dict(init_std=0.1, seed=3, device="cpu", compute_dtype=torch.bfloat16, pg=state.groups())
    emb = VocabParallelEmbedding(40, 16, name="emb", vocab_size=37, **kw)
    fc1 = ColumnParallelLinear(16, [24, 8], name="fc1", **kw)
    fc2 = RowParallelLinear(32, 16, name="fc2", **kw)
    hooks = []
    layers = (emb, fc1, fc2)
    for lin in layers:
        if fuse:
            lin.weight.main_grad = torch.zeros_like(lin.weight)
            lin.weight.grad = lin.weight.main_grad
        lin.weight.register_post_accumulate_grad_hook(lambda p: hooks.append(tuple(p.shape)))
    for _ in range(2):
        ids = torch.arange(10).reshape(5, 2) * 3 % 37  # no id twice: the embedding's sums are exact either way
        fc2(fc1(emb(ids))).float().square().sum().backward()
    in_main = all(lin.weight.grad.data_ptr() == lin.weight.main_grad.data_ptr() for lin in layers if fuse)
    grads = {"g0": emb.weight.grad.clone(), "g1": fc1.weight.grad.clone(), "g2": fc2.weight.grad.clone()}
    return {**grads, "hooks": hooks, "in_main": in_main}


def test_layers_add_weight_gradients_into_main_grad():
    """The gradient-accumulation fusion: the layers (and the embedding) add their weight gradients into ``main_grad``
    themselves and the buckets' post-accumulate hooks still fire once per backward. On CPU the product is still
    rounded to bf16 before the add (no fp32-output GEMM), so the sums equal autograd's bitwise; on CUDA one GEMM adds
    the fp32 product (test_gpu_ops.py)."""
    fused = run_distributed(_layer_grads, 1, True)[0]
    ref = run_distributed(_layer_grads, 1, False)[0]
    assert fused["hooks"] == ref["hooks"] and len(fused["hooks"]) == 6
    assert fused["in_main"]
    for k in ("g0", "g1", "g2"):
        assert fused[k].dtype == torch.float32 and fused[k].abs().sum() > 0
        assert torch.equal(fused[k], ref[k])


@pytest.mark.parametrize("impl", ["materialized", "cce"])
def test_loss_adds_the_output_weight_gradient_into_main_grad(impl):
    """The output layer's fusion: given the fp32 master and its bf16 copy, the loss adds dC into the master's
    ``main_grad`` itself (two micro-batches), the post-accumulate hook fires once per backward, padding rows stay
    zero, and the sum equals autograd's through a per-use cast (bitwise on CPU, where the product is rounded to
    bf16 before the add either way)."""
    from megasparse.loss import LossConfig, vocab_parallel_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 16, generator=g).to(torch.bfloat16)
    init = torch.randn(37, 16, generator=g) * 0.3
    t = torch.randint(0, 35, (12,), generator=g)
    t[3] = -100
    cfg = LossConfig(impl=impl)

    def run(fuse: bool):
        w = torch.nn.Parameter(init.clone())
        hooks: list[int] = []
        w.register_post_accumulate_grad_hook(lambda p: hooks.append(1))
        if fuse:
            w.main_grad = torch.zeros_like(w)
            w.grad = w.main_grad
        for _ in range(2):
            hh = h.clone().requires_grad_()
            if fuse:
                op = w.detach().to(torch.bfloat16)
                loss = vocab_parallel_loss(hh, w, t, cfg, vocab_start=0, vocab_size=35, operand=op)
            else:
                loss = vocab_parallel_loss(hh, w.to(torch.bfloat16), t, cfg, vocab_start=0, vocab_size=35)
            loss.sum().backward()
        return w, hooks

    w, hooks = run(True)
    ref, ref_hooks = run(False)
    assert w.grad.data_ptr() == w.main_grad.data_ptr() and w.grad.dtype == torch.float32
    assert hooks == ref_hooks == [1, 1]
    assert w.grad[:35].abs().sum() > 0 and not w.grad[35:].any()
    assert torch.equal(w.grad, ref.grad)
