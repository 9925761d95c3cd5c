"""Export: real DeepSpeed checkpoints (TP 2 / ZeRO 1, TP 1 x DP 2 / ZeRO 3) -> one folder -> our model, bit-exact;
vanilla exports against HuggingFace's T5 and tokenizer; mixture weights; damaged checkpoints refused."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.config import Config, ParallelConfig, TrainConfig, ZeroConfig, load_config, to_yaml
from pretrain.export import CheckpointError, export, load_pretrained, write_export
from pretrain.model import build_local_model, full_state_dict
from tests.distributed import run_distributed
from tokenizer.spm import Tokenizer

TINY = load_config(Config, "configs/tiny.yaml")


def _train_and_save(rank, world, run_dir, cfg_yaml, model_cfg, tp, stage):
    """One real optimizer step through the DeepSpeed engine, then a checkpoint; returns the gathered weights."""
    from pretrain.checkpoint import CheckpointManager, TrainerState
    from pretrain.engine import build_engine
    from pretrain.model import build_model, universal_checkpoint_info
    from pretrain.parallel import init_distributed

    dims = init_distributed(ParallelConfig(tensor=tp), seed=3)
    model = build_model(model_cfg)
    train = TrainConfig(micro_batch=2, global_batch=2 * dims.dp, lr=1e-2, warmup_steps=1)
    engine = build_engine(model, train, ZeroConfig(stage=stage), "fp32", dims.dp)
    g = torch.Generator().manual_seed(dims.dp_rank)
    ids = torch.randint(2, 1000, (2, 12), generator=g)
    loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :6], labels=ids[:, 1:7]).loss
    engine.backward(loss)
    engine.step()
    state = TrainerState(step=1, tokens_seen=0, skipped_steps=0, tp=dims.tp, dp=dims.dp)
    CheckpointManager(TINY.checkpoint, Path(run_dir) / "checkpoints", dims).save(
        engine, state, {}, cfg_yaml, universal_checkpoint_info(model, 1100))
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        full = full_state_dict(model)
    return full if rank == 0 else None


def _run(tmp_path, tokenizer_model, tp, world, stage, per_head):
    # 1100 ids padded to a multiple of 128 x TP 2
    model_cfg = dataclasses.replace(TINY.model, vocab_size=1280, mixture_per_head=per_head)
    cfg = dataclasses.replace(TINY, model=model_cfg, data=dataclasses.replace(TINY.data, tokenizer=tokenizer_model))
    run_dir = tmp_path / "run"
    full = run_distributed(_train_and_save, world, str(run_dir), to_yaml(cfg), model_cfg, tp, stage)[0]
    return run_dir, model_cfg, full


@pytest.fixture(scope="module", params=[(2, 2, 1, True), (1, 2, 3, False)], ids=["tp2-zero1", "dp2-zero3"])
def saved_run(request, tmp_path_factory, tokenizer_model):
    """(run folder, model config, gathered weights) of a real 2-process run: TP 2 / ZeRO 1 or DP 2 / ZeRO 3."""
    return _run(tmp_path_factory.mktemp("run"), tokenizer_model, *request.param)


def _logits(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1000, (2, 10), generator=g)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :5]).logits


def test_export_round_trip_bit_exact(tmp_path, saved_run):
    run_dir, model_cfg, full = saved_run
    tp = json.loads((run_dir / "checkpoints" / "step_1" / "trainer_state.json").read_text())["tp"]
    out = export(run_dir, tmp_path / "export")
    model = load_pretrained(out)
    loaded = full_state_dict(model)
    assert set(loaded) == set(full)
    assert all(torch.equal(loaded[k], full[k]) for k in full)  # the trained weights, bit for bit
    reference = build_local_model(model_cfg).eval()
    reference.load_state_dict(full, strict=False)
    assert torch.equal(_logits(model), _logits(reference))
    # the learned mixture weights: in the weights (raw) and in config.json (softmax), per layer
    config = json.loads((out / "config.json").read_text())
    weights = model.mixture_weights()
    assert set(config["synthesizer"]["mixture_weights"]) == {f"{s}.layers.{i}" for s in ("encoder", "decoder") for i in range(2)}
    for layer, w in config["synthesizer"]["mixture_weights"].items():
        assert torch.equal(torch.tensor(w), weights[layer])
        assert not torch.equal(weights[layer], torch.full_like(weights[layer], 0.5))  # moved off the init
    assert config["synthesizer"]["source"]["tp"] == tp and config["synthesizer"]["model"] == dataclasses.asdict(model_cfg)


def test_damaged_or_partial_checkpoints_are_refused(tmp_path, saved_run):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir)
    ckpt = run_dir / "checkpoints" / "step_1"
    out = tmp_path / "export"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    last = f"DP rank {state['dp'] - 1}, TP rank {state['tp'] - 1}"

    def refused(match):
        with pytest.raises(CheckpointError, match=match):
            export(run_dir, out)
        assert not out.exists() and not (tmp_path / "export.tmp").exists()

    with pytest.raises(CheckpointError, match=r"step_7 not found; available: step_1"):
        export(run_dir, out, step=7)
    optim = sorted(ckpt.glob("*optim_states.pt"))[-1]  # the last rank's shard
    saved = optim.read_bytes()
    optim.write_bytes(saved[: len(saved) // 2])  # a save cut short
    refused(rf"{optim.name} is damaged")
    optim.unlink()
    refused(rf"is partial: the ZeRO optimizer shard of {last} is missing")
    optim.write_bytes(saved)
    for f in ckpt.glob("*model_states.pt"):
        f.unlink()
    refused(r"is partial: the model states of TP rank 0 \(mp_rank_00\) are missing")
    (ckpt / "trainer_state.json").unlink()
    refused(r"is partial: trainer_state.json is missing")


def test_vanilla_export_matches_huggingface(tmp_path, tokenizer_model):
    from transformers import T5ForConditionalGeneration, T5Tokenizer, T5TokenizerFast

    cfg = dataclasses.replace(TINY.model, encoder_attention="vanilla", decoder_attention="vanilla")
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export")
    hf = T5ForConditionalGeneration.from_pretrained(out).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 1100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :6]).logits
        b = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :6]).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
    text = "The quick brown fox <extra_id_0> over 12 lazy dogs."
    expected = Tokenizer(tokenizer_model).encode(text) + [1]
    for cls in (T5TokenizerFast, T5Tokenizer):
        assert cls.from_pretrained(out)(text).input_ids == expected


def test_pure_synthesizer_layers_round_trip(tmp_path, tokenizer_model):
    cfg = dataclasses.replace(TINY.model, encoder_attention="dense", decoder_attention="factorized_random+vanilla")
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export", dtype=torch.bfloat16)
    loaded = load_pretrained(out)
    for k, v in full_state_dict(ours).items():
        assert torch.equal(full_state_dict(loaded)[k], v.to(torch.bfloat16).float()), k
    with pytest.raises(ValueError, match="already exists"):
        write_export(ours, Path(tokenizer_model), out)
    (out / "spiece.model").unlink()
    with pytest.raises(ValueError, match="spiece.model is missing"):
        load_pretrained(out)
