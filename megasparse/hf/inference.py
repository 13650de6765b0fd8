"""``megasparse eval`` (mean loss and perplexity over the held-out split, any tp/pp/dp under torchrun) and
``megasparse generate`` (greedy or temperature / top-p sampling with a KV cache, one process, CPU or one GPU).

MODEL is a megasparse run directory (or step-N), an import's directory, or a Hugging Face directory: all become a
run config with ``checkpoint.init_from``, so the weights go through the one loader the trainer uses.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from megasparse.configbase import ConfigError, apply_override, from_dict, to_dict
from megasparse.step.executor import global_mean


def model_config(model: str, overrides: list[str] = ()):
    """A run config that starts from MODEL's weights (``checkpoint.init_from``), plus dotted ``overrides``."""
    from megasparse.config import Config
    from megasparse.hf.checkpoints import run_config_of
    from megasparse.hf.convert import is_hf_dir, read_hf_config
    from megasparse.hf.names import model_overrides
    from megasparse.model.config import ModelConfig

    if is_hf_dir(model):
        cfg = Config()
        cfg.model = from_dict(ModelConfig, model_overrides(read_hf_config(model), f"{model}/config.json"))
        cfg.checkpoint.init_from = str(model)
        if (Path(model) / "tokenizer.json").is_file():
            cfg.data.tokenizer = str(Path(model) / "tokenizer.json")
    else:
        cfg, where = run_config_of(model)
        cfg.checkpoint.init_from = str(where)
    cfg.checkpoint.resume = None
    if overrides:
        data = to_dict(cfg)
        for ov in overrides:
            apply_override(data, Config, ov)
        cfg = from_dict(Config, data)
    return cfg


# ------------------------------------------------------------------------------------------------ eval
def evaluate(cfg) -> dict:
    """Mean per-token loss over every whole global batch of the validation split, at the config's layout."""
    from tqdm import tqdm

    from megasparse.train import Trainer, log0

    cfg.train.steps, cfg.train.eval_interval, cfg.filter.mode = 1, 0, "off"
    cfg.sparsity.enabled = False  # a dense model holding W ⊙ M: the weights a 2:4 run computed with
    init, cfg.checkpoint.init_from = cfg.checkpoint.init_from, None
    tr = Trainer(cfg)
    from megasparse.hf.convert import init_from

    init_from(init, tr.model, cfg.model, tr.vocab, masked=True)
    tr.dp_opt.keep_compute_copies()  # the compute copies (bf16 on GPU) read the weights just loaded
    gbs = cfg.train.global_batch_size
    n = len(tr.valid_ds) // gbs
    if n == 0:
        raise ConfigError(f"the validation split has {len(tr.valid_ds)} samples, fewer than one global batch ({gbs})")
    total = torch.zeros((), dtype=torch.float64, device=tr.device)
    tokens = 0
    bar = tqdm(range(n), desc="eval", disable=tr.lay.pp_rank != tr.lay.pp - 1 or tr.lay.tp_rank or tr.lay.dp_rank)
    for k in bar:
        batches = tr._microbatches(tr.valid_ds, k * gbs, tr.num_mb)
        with torch.no_grad():
            s, t = tr.forward_backward(batches, False, tr.step)
        total += s
        tokens += t
    loss = global_mean(total, tokens, tr.lay.is_last_stage, tr.device)
    res = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens * tr.dp, "batches": n}
    log0(f"eval: {n} batches, {res['tokens']} tokens, loss {loss:.6f}, perplexity {res['perplexity']:.4f}")
    return res


def eval_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megasparse eval", description="Loss and perplexity on the held-out split.")
    p.add_argument("model", help="a run's out_dir, a step-N directory, an hf import's directory or an HF directory")
    p.add_argument("--data", required=True, help="indexed-dataset prefix (its validation split is read)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 data.valid_fraction=0.1")
    a = p.parse_intermixed_args(argv)
    from megasparse.parallel import state

    try:
        evaluate(model_config(a.model, [f"data.prefix={a.data}", *a.overrides]))
    except ConfigError as e:
        if state.world_env()[0] == 0:
            print(f"megasparse: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            state.destroy()
    return 0


# -------------------------------------------------------------------------------------------- generate
def load_single(cfg, device: str = "auto"):
    """The whole model in this process (tp = pp = 1), weights from ``cfg.checkpoint.init_from``."""
    import torch.distributed as dist

    from megasparse.hf.convert import init_from
    from megasparse.model.builder import build_model, resolve_device, resolve_dtype
    from megasparse.parallel import state

    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp = cfg.parallel.pp = cfg.parallel.virtual_stages = 1
    cfg.parallel.sequence_parallel, cfg.parallel.layer_split = False, None
    cfg.loss.vocab_over_pp = False
    cfg.train.device = device
    if cfg.model.vocab_size is None:
        raise ConfigError("model.vocab_size is not set in the model's config; give model.vocab_size=N")
    if not dist.is_initialized():
        state.init(1, 1, False, "gloo" if device == "cpu" or not torch.cuda.is_available() else cfg.dist_backend())
    dev = resolve_device(cfg)
    model = build_model(cfg, cfg.model.vocab_size, device=dev, compute_dtype=resolve_dtype(cfg, dev))
    init_from(cfg.checkpoint.init_from, model, cfg.model, cfg.model.vocab_size, masked=True)
    return model.eval()


class KVCache:
    """Per layer, the keys and values of every position so far: [b, kv heads, t, d]."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]


@torch.no_grad()
def step_logits(model, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, vocab] of the token after ``ids`` [b, t] (fp32), attending to the cache, which grows by t."""
    from megasparse.ops.rope_kernels import rope_reference

    start, (b, t) = cache.length, ids.shape
    cos, sin = model.rope(start + t)
    pos = torch.arange(start, start + t, device=ids.device)
    x = model.embedding(ids.t().contiguous())  # [t, b, h]
    for i, block in enumerate(model.layers):
        a = block.attn
        qkv = a.qkv(block.attn_norm(x))
        if a.qkv_bias is not None:
            qkv = qkv + a.qkv_bias.to(qkv.dtype)
        d = qkv.shape[-1] // (a.nq + 2 * a.nkv)
        heads = qkv.view(t, b, a.nq + 2 * a.nkv, d).permute(1, 2, 0, 3)  # [b, heads, t, d]
        q = rope_reference(heads[:, : a.nq], cos, sin, pos)
        k = rope_reference(heads[:, a.nq : a.nq + a.nkv], cos, sin, pos)
        v = heads[:, a.nq + a.nkv :]
        if cache.k[i] is not None:
            k, v = torch.cat([cache.k[i], k], 2), torch.cat([cache.v[i], v], 2)
        cache.k[i], cache.v[i] = k, v
        rep = a.nq // a.nkv
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        mask = torch.ones(t, start + t, dtype=torch.bool, device=ids.device).tril(start)  # query j sees ≤ start+j
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=d**-0.5)
        x = x + a.proj(o.permute(2, 0, 1, 3).reshape(t, b, a.nq * d))
        x = x + block.mlp(block.mlp_norm(x))
    h = model.final_norm(x[-1])  # [b, h]
    w = model.output_weight[: model.vocab_size]
    return h.float() @ w.float().t()


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """[b] next ids: argmax at temperature 0, else a draw from the top-p nucleus of softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        p, idx = probs.sort(-1, descending=True)
        drop = p.cumsum(-1) - p >= top_p  # keep the smallest prefix reaching top_p (at least one token)
        p = p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos: int | None = None,
) -> list[int]:
    """The new token ids after ``prompt`` (one sequence), with a KV cache: the prompt once, then a token a step."""
    dev = model.embedding.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    cache = KVCache(len(model.layers))
    ids = torch.tensor([prompt], device=dev)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = sample(step_logits(model, ids, cache), temperature, top_p, gen)
        out.append(int(nxt[0]))
        if eos is not None and out[-1] == eos:
            break
        ids = nxt[:, None]
    return out


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megasparse generate", description="Generate tokens with a KV cache.")
    p.add_argument("model", help="a run's out_dir, a step-N directory, an hf import's directory or an HF directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    g.add_argument("--prompt-ids", help="comma-separated token ids; the generated ids are printed last")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a = p.parse_args(argv)
    try:
        cfg = model_config(a.model)
        tok = None
        if a.prompt is not None:
            from megasparse.data.tokenizer import load_tokenizer

            tok = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.data.tokenizer_vocab)
            prompt = tok.encode(a.prompt).ids
        else:
            try:
                prompt = [int(x) for x in a.prompt_ids.replace(" ", "").split(",") if x]
            except ValueError as e:
                raise ConfigError(f"--prompt-ids={a.prompt_ids!r}: give comma-separated integers") from e
        if not prompt or max(prompt) >= (cfg.model.vocab_size or 0) or min(prompt) < 0:
            raise ConfigError(f"the prompt's ids must lie in [0, {cfg.model.vocab_size}) and not be empty")
        model = load_single(cfg, a.device)
        ids = generate(model, prompt, a.max_new_tokens, a.temperature, a.top_p, a.seed)
    except ConfigError as e:
        print(f"megasparse: error: {e}", file=sys.stderr, flush=True)
        return 2
    if tok is not None:
        print(tok.decode(prompt + ids))  # the prompt and its continuation, as the tokenizer joins them
    else:
        print(" ".join(map(str, ids)))
    return 0
