"""An 8B-shaped Llama (Llama-3.1-8B's config, random bf16 weights, no download) read by ``checkpoint.init_from`` at
TP2 x PP2 on 4 GPUs, saved as a megasparse checkpoint and exported again: wall time and peak host memory per rank.

    python benchmarks/bench_hf_import.py --workdir /tmp/hf8b                    # writes the HF dir (~16 GB) once
    torchrun --nproc_per_node 4 benchmarks/bench_hf_import.py --workdir /tmp/hf8b --load
    python benchmarks/bench_hf_import.py --workdir /tmp/hf8b --export

``--layers N`` shrinks the model (same widths) for a quick check. Each phase prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_hf(path: Path, layers: int) -> None:
    """config.json from transformers' LlamaConfig and one bf16 safetensors shard per layer (random normal)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    h, f, kv, v = 4096, 14336, 8 * 128, 128256
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rnd(v, h)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append({
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
            p + "mlp.down_proj.weight": rnd(h, f),
        })  # fmt: skip
    shards.append({"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rnd(v, h)})
    weight_map = {}
    for k, sd in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def load(work: Path, tp: int, pp: int) -> None:
    import torch.distributed as dist

    from megasparse import checkpoint as ckpt
    from megasparse.hf.convert import init_from
    from megasparse.hf.inference import model_config
    from megasparse.model.builder import build_model
    from megasparse.parallel import state

    cfg = model_config(str(work / "hf"), [f"parallel.tp={tp}", f"parallel.pp={pp}", "model.seq_length=4096",
                                          "data.prefix=synthetic", "train.global_batch_size=1",
                                          "train.micro_batch_size=1", f"logging.out_dir={work / 'run'}"])  # fmt: skip
    cfg.validate(state.world_env()[1])
    state.init(tp, pp, False, cfg.dist_backend())
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(cfg, cfg.model.vocab_size, device=dev, compute_dtype=torch.bfloat16)
    dist.barrier()
    t = time.perf_counter()
    init_from(cfg.checkpoint.init_from, model, cfg.model, cfg.model.vocab_size)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    ckpt.save(work / "run" / "checkpoints", 0, model, None, {})
    t_save = time.perf_counter() - t
    if dist.get_rank() == 0:
        from megasparse.config import dump_config

        dump_config(cfg, work / "run" / "config.yaml")
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"phase": "init_from+save", "rank": dist.get_rank(), "params": n, "load_s": round(t_load, 1),
                      "save_s": round(t_save, 1), "peak_host_gib": round(peak_rss_gib(), 2)}), flush=True)  # fmt: skip
    state.destroy()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="/tmp/hf8b")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--load", action="store_true", help="under torchrun: init_from at --tp x --pp, then save")
    p.add_argument("--export", action="store_true", help="export the saved checkpoint to <workdir>/exported")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    a = p.parse_args()
    work = Path(a.workdir)
    if a.load:
        load(work, a.tp, a.pp)
    elif a.export:
        from megasparse.hf.checkpoints import export_hf

        t = time.perf_counter()
        export_hf(work / "run", work / "exported", "bf16")
        print(json.dumps({"phase": "export", "s": round(time.perf_counter() - t, 1),
                          "peak_host_gib": round(peak_rss_gib(), 2)}))  # fmt: skip
    else:
        t = time.perf_counter()
        write_hf(work / "hf", a.layers)
        print(json.dumps({"phase": "write_hf", "s": round(time.perf_counter() - t, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
