"""Hugging Face import/export, checkpoint.init_from, eval and generate against transformers (tiny random models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from tiny import TRAINING

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_models import SPECS, hf_logits, hf_model, save_models  # noqa: E402

RUN = {
    "data.prefix": "synthetic", "model.seq_length": 16, "train.micro_batch_size": 2, "train.global_batch_size": 4,
    "train.dtype": "fp32", "train.device": "cpu", "train.eval_interval": 0, "parallel.backend": "gloo",
    **{k.replace("__", "."): v for k, v in TRAINING.items()},
}  # fmt: skip
DP2 = ("qwen2",)
"""Trained at tp 2 x dp 2; the others at tp 2 x pp 2 (llama32: tied embeddings over the pipeline's embedding group)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return save_models(tmp_path_factory.mktemp("hf"))


TRAINED = ("llama", "llama32", "qwen2")
FILTERED = ["filter.mode=collider", "filter.scorer=loss", "filter.keep_ratio=0.5"]
"""Qwen2 trains with the compact backward, which carries the q/k/v bias gradient through the attention."""


def run_models(dirs: dict[str, str], parallel: dict[str, list[str]], out_dir: str) -> dict:
    """Per model: this rank's logits slice of one validation micro-batch (last stage, dp rank 0); Llama and Qwen2
    (filtered) also train two steps: losses, the whole trained model; Llama saves a checkpoint in ``out_dir``."""
    from megasparse.config import dump_config
    from megasparse.hf.inference import model_config
    from megasparse.parallel.consolidate import full_state_dict
    from megasparse.train import Trainer

    res = {}
    for name, path in dirs.items():
        ov = [f"{k}={v}" for k, v in RUN.items()] + parallel.get(name, []) + [f"logging.out_dir={out_dir}"]
        ov += FILTERED if name == "qwen2" else []
        cfg = model_config(path, ov)
        tr = Trainer(cfg)
        cap: dict = {}
        if tr.lay.is_last_stage:
            tr.model.final_norm.register_forward_hook(lambda m, i, o, cap=cap: cap.update(h=cap.get("h", o.detach())))
        batches = tr._microbatches(tr.valid_ds, 0, 1)
        with torch.no_grad():
            tr.forward_backward(batches, False, tr.step)
        r: dict = {"ids": batches[0].tokens[:, :-1]}
        if "h" in cap and tr.lay.dp_rank == 0:  # [s, b, h] @ this TP rank's vocabulary rows
            r["logits"] = (cap["h"] @ tr.model.output_weight.t()).transpose(0, 1)
            r["vocab_start"] = tr.model.vocab_start
        if name in TRAINED:
            r["losses"] = [tr.train_step().loss for _ in range(2)]
            r["weights"] = full_state_dict(tr.model)
            if tr.model.tied and tr.lay.pp > 1:  # this stage's copy of the tied embedding
                r["tied"] = (tr.model.output_weight if tr.lay.is_last_stage else tr.model.embedding.weight).detach()
        if name == "llama":
            tr.save()
            if torch.distributed.get_rank() == 0:
                dump_config(cfg, Path(out_dir) / "config.yaml")
        res[name] = r
    return res


def whole_logits(ranks: list[dict], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, s], logits [b, s, vocab]) from the ranks' slices, in vocabulary order."""
    parts = sorted((r[name] for r in ranks if "logits" in r[name]), key=lambda r: r["vocab_start"])
    logits = torch.cat([p["logits"] for p in parts], -1)
    return parts[0]["ids"], logits


@pytest.mark.slow
def test_imported_logits_and_training_match_transformers_at_tp1_and_tp2_pp2(dirs, tmp_path):
    """Imported weights give transformers' logits (fp32, 1e-5) at tp 1 and at tp 2 x pp 2 (Qwen2 at tp 2 x dp 2); two
    training steps at tp 2 x pp 2 equal tp 1, tied embeddings included (one parameter at pp 1, two copies summed
    over the embedding group at pp 2); the tp 2 x pp 2 checkpoint exports with the trained weights."""
    from megasparse.hf.checkpoints import export_hf

    layouts = {n: ["parallel.tp=2"] + ([] if n in DP2 else ["parallel.pp=2"]) for n in dirs}
    one = run_distributed(run_models, 1, dirs, {}, str(tmp_path / "one"))
    four = run_distributed(run_models, 4, dirs, layouts, str(tmp_path / "four"))
    for name, path in dirs.items():
        for ranks in (one, four):
            ids, got = whole_logits(ranks, name)
            ref = hf_logits(path, ids)
            assert rel(got[..., : ref.shape[-1]], ref) < 1e-5, (name, rel(got[..., : ref.shape[-1]], ref))
    for name in TRAINED:
        a, b = one[0][name], four[0][name]
        assert all(abs(x - y) / abs(y) < 1e-5 for x, y in zip(b["losses"], a["losses"])), (name, a, b)
        assert a["losses"][0] != a["losses"][1]
        n = 320  # the real vocabulary rows (the padding differs with tp)
        assert max(rel(b["weights"][k][:n], a["weights"][k][:n]) for k in a["weights"]) < 1e-5, name
    assert torch.equal(four[0]["llama32"]["tied"], four[2]["llama32"]["tied"])  # rank 2: pp 1, tp 0
    bias = [hf_model("qwen2").model.layers[1].self_attn.get_submodule(f"{x}_proj").bias for x in "qkv"]
    assert rel(one[0]["qwen2"]["weights"]["layers.1.attn.qkv_bias"], torch.cat(bias).detach()) > 1e-4  # it trained
    a, b = one[0]["llama"], four[0]["llama"]
    out = export_hf(tmp_path / "four", tmp_path / "exported", "fp32")
    from safetensors.torch import load_file

    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    w = b["weights"]
    assert torch.equal(exported["model.layers.1.mlp.down_proj.weight"], w["layers.1.mlp.fc2.weight"])
    q = exported["model.layers.3.self_attn.q_proj.weight"]
    assert torch.equal(q, w["layers.3.attn.qkv.weight"][: q.shape[0]])
    assert torch.equal(exported["lm_head.weight"], w["output_weight"][: exported["lm_head.weight"].shape[0]])


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".safetensors", ".json")}


@pytest.mark.parametrize("name", ["llama31", "qwen2"])
def test_export_import_export_is_bitwise_and_loads_in_transformers(dirs, tmp_path, name):
    from transformers import AutoModelForCausalLM

    from megasparse.hf.checkpoints import export_hf, import_hf

    e1 = export_hf(import_hf(dirs[name], tmp_path / "ms1"), tmp_path / "e1", "fp32", shard_bytes=100_000)
    e2 = export_hf(import_hf(e1, tmp_path / "ms2"), tmp_path / "e2", "fp32", shard_bytes=100_000)
    assert len(list(e1.glob("*.safetensors"))) > 1  # the second import read several shards through the index
    assert _files(e1) == _files(e2)
    model, info = AutoModelForCausalLM.from_pretrained(e1, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, hf_logits(dirs[name], ids))
    bf16 = export_hf(tmp_path / "ms1", tmp_path / "bf16", "bf16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_generate_greedy_matches_transformers(dirs, capsys):
    """`megasparse generate --prompt-ids` (past model.seq_length, so the RoPE tables grow) and the function, with
    a KV cache, give transformers' greedy ids."""
    from megasparse.hf.inference import generate, generate_main, load_single, model_config
    from megasparse.parallel import state

    prompt = [3, 17, 250, 9, 41]
    try:
        for name in ("llama31", "qwen2"):
            hf = hf_model(name)
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
            if name == "llama31":
                assert generate_main([dirs[name], "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                                      "24", "--device", "cpu"]) == 0  # fmt: skip
                got = [int(x) for x in capsys.readouterr().out.strip().splitlines()[-1].split()]
            else:
                model = load_single(model_config(dirs[name], ["model.seq_length=16"]), "cpu")
                got = generate(model, prompt, 24)
                sampled = generate(model, prompt, 8, temperature=1.0, top_p=0.9, seed=3)
                assert len(sampled) == 8 and max(sampled) < 320
            assert got == want, (name, got, want)
    finally:
        state.destroy()


def test_eval_matches_transformers_loss(dirs, tmp_path, tiny_tokenizer, capsys):
    """`megasparse eval HF_DIR --data PREFIX`: the mean loss over the validation split is transformers'."""
    import numpy as np

    from megasparse.data.dataset import build_datasets, iterate_batches
    from megasparse.data.indexed import write_indexed
    from megasparse.hf.inference import eval_main, model_config

    hf = tmp_path / "llama"
    shutil.copytree(dirs["llama"], hf)
    shutil.copy(tiny_tokenizer, hf / "tokenizer.json")
    rng = np.random.default_rng(0)
    write_indexed(tmp_path / "corpus", [rng.integers(0, 299, 200) for _ in range(20)])
    ov = ["model.seq_length=16", "train.global_batch_size=4", "train.micro_batch_size=2", "train.device=cpu",
          "train.dtype=fp32", "parallel.backend=gloo", "data.valid_fraction=0.2",
          f"logging.out_dir={tmp_path}"]  # fmt: skip
    assert eval_main([str(hf), "--data", str(tmp_path / "corpus"), *ov]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    loss = float(line.split("loss ")[1].split(",")[0])
    cfg = model_config(str(hf), [f"data.prefix={tmp_path / 'corpus'}", *ov])
    valid = build_datasets(cfg.data, 16, 320)[1]
    it = iterate_batches(valid, 4)
    toks = torch.cat([next(it).tokens for _ in range(len(valid) // 4)])
    logits = hf_logits(str(hf), toks[:, :-1])
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1)).item()
    assert abs(loss - ref) / ref < 1e-5, (loss, ref)


def _one_line(fn, *args) -> str:
    from megasparse.configbase import ConfigError

    with pytest.raises(ConfigError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_input_is_one_line(dirs, tmp_path):
    from megasparse.hf.checkpoints import import_hf

    src = Path(dirs["llama31"])

    def variant(tag: str, **changes) -> Path:
        d = tmp_path / tag
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    out = tmp_path / "out"
    assert "GPT2LMHeadModel" in _one_line(import_hf, variant("arch", architectures=["GPT2LMHeadModel"]), out)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    assert "yarn" in _one_line(import_hf, variant("yarn", rope_scaling=None, rope_parameters=yarn), out)
    assert "sliding" in _one_line(import_hf, variant("sw", sliding_window=4096), out)
    assert "o_proj" in _one_line(import_hf, variant("ob", attention_bias=True), out)
    assert "mlp_bias" in _one_line(import_hf, variant("mb", mlp_bias=True), out)
    assert "gate_proj" in _one_line(import_hf, variant("shape", intermediate_size=96), out)
    trunc = variant("trunc")
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    assert "truncated" in _one_line(import_hf, trunc, out)
    missing = variant("missing")
    keys = json.loads((src / "model.safetensors").read_bytes()[8:][: int.from_bytes(
        (src / "model.safetensors").read_bytes()[:8], "little")])  # fmt: skip
    index = {"weight_map": {k: "model-00002-of-00002.safetensors" for k in keys if k != "__metadata__"}}
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "missing" in _one_line(import_hf, missing, out)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    big = variant("tok")
    Tokenizer(WordLevel({f"t{i}": i for i in range(400)}, unk_token="t0")).save(str(big / "tokenizer.json"))
    assert "400 tokens" in _one_line(import_hf, big, out)
    from megasparse.config import load_config

    ov = ["model.tie_embeddings=true", "parallel.pp=2", "parallel.distributed_optimizer=true"]
    tied = load_config(None, ov + ["data.prefix=synthetic", "model.vocab_size=256", f"logging.out_dir={tmp_path}"])
    assert "distributed_optimizer" in _one_line(tied.validate, 2)
    assert set(SPECS) >= {"llama", "llama31", "llama32", "qwen2"}


def train_sparse(hf_dir: str, out_dir: str) -> None:
    from megasparse.config import dump_config
    from megasparse.hf.inference import model_config
    from megasparse.train import Trainer

    ov = [f"{k}={v}" for k, v in RUN.items()] + ["sparsity.enabled=true", f"logging.out_dir={out_dir}"]
    cfg = model_config(hf_dir, ov)
    tr = Trainer(cfg)
    tr.train_step()
    tr.save()
    dump_config(cfg, Path(out_dir) / "config.yaml")


def test_sparse24_run_exports_masked_weights(dirs, tmp_path):
    """A 2:4 run from imported weights exports W ⊙ M: at most two non-zeros in every group of four inputs."""
    from safetensors.torch import load_file

    from megasparse.hf.checkpoints import export_hf

    run_distributed(train_sparse, 1, dirs["llama"], str(tmp_path / "run"))
    out = export_hf(tmp_path / "run", tmp_path / "e", "fp32")
    w = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    for key in ("model.layers.0.mlp.gate_proj.weight", "model.layers.2.mlp.down_proj.weight"):
        nz = (w[key] != 0).reshape(-1, 4).sum(-1)
        assert nz.max() <= 2 and nz.float().mean() > 1.9, key
    assert (w["model.layers.0.self_attn.q_proj.weight"] != 0).float().mean() > 0.99  # attention stays dense
    from megasparse.hf.inference import load_single, model_config
    from megasparse.parallel import state

    try:  # generate/eval on the run directory compute with the same W ⊙ M
        model = load_single(model_config(str(tmp_path / "run")), "cpu")
        assert torch.equal(model.layers[0].mlp.fc1.weight[:128], w["model.layers.0.mlp.gate_proj.weight"])
    finally:
        state.destroy()


def gpu_filtered_step(hf_dir: str, out_dir: str) -> dict:
    from megasparse.hf.inference import model_config
    from megasparse.train import Trainer

    ov = [f"{k}={v}" for k, v in RUN.items() if not k.startswith(("train.dtype", "train.device", "parallel.backend"))]
    cfg = model_config(hf_dir, ov + FILTERED + ["train.dtype=bf16", "train.device=cuda", f"logging.out_dir={out_dir}"])
    tr = Trainer(cfg)
    batches = tr._microbatches(tr.valid_ds, 0, 1)
    with torch.no_grad():
        s, t = tr.forward_backward(batches, False, tr.step)
    return {"ids": batches[0].tokens.cpu(), "loss": (s / t).item(), "steps": [tr.train_step().loss for _ in range(2)]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_qwen2_bf16_loss_filtered_steps_and_generate(dirs, tmp_path):
    """On the GPU (bf16, cuDNN attention with the q/k/v bias): the imported Qwen2's loss is transformers' within bf16
    error, two Collider steps run finite, and fp32 greedy generation on the GPU equals transformers' on the CPU."""
    from megasparse.hf.inference import generate, load_single, model_config
    from megasparse.parallel import state

    r = run_distributed(gpu_filtered_step, 1, dirs["qwen2"], str(tmp_path))[0]
    ids = r["ids"]
    logits = hf_logits(dirs["qwen2"], ids[:, :-1])
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
    assert abs(r["loss"] - ref) / ref < 2e-2, (r["loss"], ref)
    assert all(torch.isfinite(torch.tensor(r["steps"])))
    prompt = [3, 17, 250, 9, 41]
    want = hf_model("qwen2").generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, 5:].tolist()
    try:
        model = load_single(model_config(dirs["qwen2"], ["train.dtype=fp32", "model.seq_length=16"]), "cuda")
        assert generate(model, prompt, 16) == want
    finally:
        state.destroy()


def test_import_and_export_never_write_over_a_directory(tmp_path) -> None:
    """An earlier run, import or export in OUT_DIR is left as it was: both commands refuse in one line."""
    from megasparse.hf.checkpoints import export_hf, import_hf
    from megasparse.hf.names import HFError

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for call in (lambda: import_hf(tmp_path / "hf", out), lambda: export_hf(tmp_path / "ckpt", out)):
        with pytest.raises(HFError, match="already exists and is not empty"):
            call()
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and sorted(p.name for p in out.iterdir()) == [
        "checkpoints",
        "metrics.jsonl",
    ]
