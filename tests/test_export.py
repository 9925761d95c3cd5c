"""Export: real DeepSpeed checkpoints (TP 2 / ZeRO 1, DP 2 / ZeRO 3, DP 2 / ZeRO 1 bf16) -> a (sharded) folder -> our model,
bit-exact, and HuggingFace's AutoModelForSeq2SeqLM (remote code) with our logits; vanilla exports are plain HF T5
(with HF's tokenizer); Synthesizer exports refuse to load without trust_remote_code; generation equals ours;
incomplete, damaged or code-carrying checkpoints are refused. Constant parameters (norm weights, mixture logits,
biases) are randomised so a swapped mapping shows."""
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForSeq2SeqLM

from pretrain.core.config import Config, ParallelConfig, TrainConfig, UsageError, ZeroConfig, load_config, to_yaml
from pretrain.core.manifest import describe
from pretrain.model import build_local_model, full_state_dict, generate_greedy, load_full_state_dict
from pretrain.model.mixers import MIXERS
from pretrain.runtime.faults import EXIT_USAGE
from pretrain.transfer.exporting import CheckpointError, export, load_pretrained, write_export
from tests.distributed import disk_full, launch_like_srun, run_distributed
from tests.registry import assert_covers
from tests.test_checkpoint import _overwrite_middle
from tests.test_hf_parity import randomize_constant_parameters
from tokenizer.spm import Tokenizer

TINY = load_config(Config, "configs/tiny.yaml")
REPO = Path(__file__).resolve().parents[1]


def _train_and_save(rank, world, run_dir, cfg_yaml, model_cfg, tp, stage, precision):
    """One real optimizer step through the DeepSpeed engine, then a checkpoint; returns the gathered weights."""
    from pretrain.distributed.parallel import init_distributed
    from pretrain.model import build_model, universal_checkpoint_info
    from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs
    from pretrain.runtime.engine import build_engine

    dims = init_distributed(ParallelConfig(tensor=tp), seed=3)
    model = build_model(model_cfg)
    train = TrainConfig(micro_batch=2, global_batch=2 * dims.dp, lr=1e-2, warmup_steps=1)
    engine = build_engine(model, train, ZeroConfig(stage=stage), precision, dims.dp)
    g = torch.Generator().manual_seed(dims.dp_rank)
    ids = torch.randint(2, 1000, (2, 12), generator=g)
    loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :6], labels=ids[:, 1:7]).loss
    engine.backward(loss)
    engine.step()
    CheckpointManager(TINY.checkpoint, Path(run_dir) / "checkpoints", dims, engine=engine,
                      progress=Progress(step=1, tokens_seen=2 * 18 * dims.dp), data=None,
                      inputs=RunInputs.of(yaml.safe_load(cfg_yaml)["data"]["tokenizer"]), config_yaml=cfg_yaml,
                      universal_info=universal_checkpoint_info(model, 1100)).save(1)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        full = full_state_dict(model)
    return full if rank == 0 else None


def _run(tmp_path, tokenizer_model, tp, world, stage, per_head, precision):
    # the tokenizer's 1100 ids: 1280 rows at TP 2, 1152 in the TP 1 model the export reads them into
    model_cfg = dataclasses.replace(TINY.model, vocab_size=1100, mixture_per_head=per_head)
    cfg = dataclasses.replace(TINY, model=model_cfg, data=dataclasses.replace(TINY.data, tokenizer=tokenizer_model))
    run_dir = tmp_path / "run"
    full = run_distributed(_train_and_save, world, str(run_dir), to_yaml(cfg), model_cfg, tp, stage, precision)[0]
    return run_dir, model_cfg, full, precision


@pytest.fixture(scope="module", params=[(2, 2, 1, True, "fp32"), (1, 2, 3, False, "fp32"), (1, 2, 1, True, "bf16")],
                ids=["tp2-zero1", "dp2-zero3", "dp2-zero1-bf16"])
def saved_run(request, tmp_path_factory, tokenizer_model):
    """(run folder, model config, gathered weights, precision) of a real 2-process run: TP 2 / ZeRO 1, DP 2 /
    ZeRO 3, or DP 2 / ZeRO 1 in bf16 (DeepSpeed's BF16_Optimizer, the shipped size configs' setting)."""
    return _run(tmp_path_factory.mktemp("run"), tokenizer_model, *request.param)


def _logits(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1000, (2, 10), generator=g)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :5]).logits


def _batch(seed: int = 1):
    """Encoder ids with one padded row, decoder ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return ids.masked_fill(mask == 0, 0), mask, torch.randint(2, 1100, (3, 7), generator=g)


def _assert_same_as_ours(ours, hf) -> None:
    """Logits within 1e-5 of the largest, and HF's cached greedy generate equals ours token for token."""
    ids, mask, dec = _batch()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        b = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    # ours also has the (masked) padding rows of its TP layout; HF holds the token ids only
    assert (a[..., b.shape[-1]:] == torch.finfo(a.dtype).min).all()
    a = a[..., : b.shape[-1]]
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
    expected = generate_greedy(ours, ids, mask, max_new_tokens=12)
    generated = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(generated[:, 1:], expected)  # HF keeps the start token


def test_export_round_trip_bit_exact(tmp_path, saved_run):
    run_dir, model_cfg, full, precision = saved_run
    tp = json.loads((run_dir / "checkpoints" / "step_1" / "trainer_state.json").read_text())["tp"]
    out = export(run_dir, tmp_path / "export", max_shard_size="200KB")
    # the tokenizer the model was trained with: the checkpoint's copy
    assert (out / "spiece.model").read_bytes() == (run_dir / "checkpoints" / "step_1" / "spiece.model").read_bytes()
    # sharded as HF's save_pretrained shards: numbered files plus the index naming every tensor's file
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards == sorted(set(index["weight_map"].values()))
    assert not (out / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    model = load_pretrained(out)
    loaded = full_state_dict(model)
    assert set(loaded) == set(full)
    # fp32: the trained weights, bit for bit; bf16: the fp32 master weights, which round to the trained bf16 ones
    assert all(torch.equal(loaded[k].to(full[k].dtype), full[k]) for k in full)
    if precision == "bf16":
        assert not all(torch.equal(loaded[k], full[k].float()) for k in full)  # the master, not the bf16 copy
    else:
        reference = build_local_model(model_cfg).eval()
        load_full_state_dict(reference, full)
        assert torch.equal(_logits(model), _logits(reference))
    # the learned mixture weights: in the weights (raw) and in config.json (softmax), per layer
    config = json.loads((out / "config.json").read_text())
    weights = model.mixture_weights()
    assert set(config["synthesizer"]["mixture_weights"]) == {f"{s}.layers.{i}" for s in ("encoder", "decoder") for i in range(2)}
    for layer, w in config["synthesizer"]["mixture_weights"].items():
        assert torch.equal(torch.tensor(w), weights[layer])
        assert not torch.equal(weights[layer], torch.full_like(weights[layer], 0.5))  # moved off the init
    assert config["synthesizer"]["source"]["tp"] == tp and config["synthesizer"]["model"] == dataclasses.asdict(model_cfg)
    # HuggingFace reads the same shards through the shipped remote code
    _assert_same_as_ours(model, AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True).eval())
    card = (out / "README.md").read_text()
    assert "| encoder self-attention | `random+vanilla` |" in card and "- steps: 1" in card
    assert f"- tokens seen: {config['synthesizer']['source']['tokens_seen']:,}" in card
    assert "trust_remote_code=True" in card


def test_a_published_export_names_no_path_of_the_training_machine(tmp_path, saved_run, tokenizer_model):
    # the run's folder, its data and its tokenizer live in absolute paths here; the export's text files say where
    # the weights come from by names (run, checkpoint in it, the data's last two parts)
    run_dir = tmp_path / "machine" / "runs" / "tiny"
    shutil.copytree(saved_run[0], run_dir)
    ckpt = run_dir / "checkpoints" / "step_1"
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["data"]["train"] = str(tmp_path / "machine" / "data" / "c4" / "shards")
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    _with_size_listed(ckpt, ckpt / "config.yaml")
    out = export(run_dir, tmp_path / "export")
    machine = [str(tmp_path), str(Path.home()), str(REPO), str(Path(tokenizer_model).parent)]
    for f in out.iterdir():
        if not f.name.endswith(".safetensors"):
            assert not [m for m in machine if m.encode() in f.read_bytes()], f.name
    source = json.loads((out / "config.json").read_text())["synthesizer"]["source"]
    assert (source["run"], source["checkpoint"], source["data"]) == ("tiny", "checkpoints/step_1", "c4/shards")
    card = (out / "README.md").read_text()
    assert "- run: tiny\n" in card and "- checkpoint (in the run folder): checkpoints/step_1\n" in card
    # a corpus mixture (data.sources): its sources, weights and shard counts (DP rank 0's data state records them),
    # where the export recorded "data": "" and the card nothing
    config["data"]["train"] = ""
    config["data"]["sources"] = [{"name": n, "train": str(tmp_path / "machine" / "data" / n / "shards"), "weight": w,
                                  "valid": ""} for n, w in (("c4", 0.7), ("wiki", 0.3))]
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"sources": [{"name": n, "weight": w, "shards": [[f"{i}.tar", 10] for i in range(k)]}
                            for n, w, k in (("c4", 0.7, 8), ("wiki", 0.3, 2))]}, ckpt / "data_dp0.pt")
    _with_size_listed(ckpt, ckpt / "config.yaml")
    _with_size_listed(ckpt, ckpt / "data_dp0.pt")
    out = export(run_dir, tmp_path / "mixture_export")
    assert not [m for f in out.iterdir() if not f.name.endswith(".safetensors") for m in machine if m.encode() in f.read_bytes()]
    source = json.loads((out / "config.json").read_text())["synthesizer"]["source"]
    assert source["data"] == "mixture: c4 0.7 (c4/shards, 8 shards), wiki 0.3 (wiki/shards, 2 shards)"
    assert source["sources"][1] == {"name": "wiki", "weight": 0.3, "train": "wiki/shards", "shards": 2}
    assert f"- data: {source['data']}\n" in (out / "README.md").read_text()


def test_the_per_parameter_reader_equals_deepspeeds_consolidation(tmp_path, saved_run):
    # what the export streams, parameter by parameter, against DeepSpeed's zero_to_fp32 reading each TP rank's
    # files whole (it cannot read BF16_Optimizer's files: those are checked against the trained weights above)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from pretrain.transfer.exporting import _tp_rank_state, _weights_only

    run_dir, _, _, precision = saved_run
    if precision == "bf16":
        pytest.skip("zero_to_fp32 does not read BF16_Optimizer's files")
    ckpt = run_dir / "checkpoints" / "step_1"
    tp = json.loads((ckpt / "trainer_state.json").read_text())["tp"]
    for mp in range(tp):
        files = sorted(ckpt.glob(f"*mp_rank_{mp:02d}_*states.pt"))
        view = tmp_path / f"mp{mp}" / "tag"
        view.mkdir(parents=True)
        for f in files:
            (view / f.name).symlink_to(f)
        with _weights_only():
            expected = get_fp32_state_dict_from_zero_checkpoint(str(view.parent), tag="tag")
        ours = _tp_rank_state(ckpt, files, mp)
        assert set(expected) <= set(ours)  # ours also lists the module's non-tensor `_extra_state`
        assert all(torch.equal(ours[name](), value) for name, value in expected.items())


def _with_size_listed(ckpt: Path, file: Path) -> None:
    """Update complete.json after rewriting `file`, as a save that wrote these very bytes would have."""
    marker = json.loads((ckpt / "complete.json").read_text())
    marker["files"].update(describe(ckpt, [file]))
    (ckpt / "complete.json").write_text(json.dumps(marker))


class _RunsCode:
    """A pickle that would run a shell command when unpickled without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_export_holds_about_one_model_in_host_memory(tmp_path, tokenizer_model):
    # a ~40 MB model's checkpoint as the shipped recipe saves it (bf16, ZeRO 1: BF16_Optimizer's flat fp32
    # partitions), exported in a fresh process: the peak resident set above the imports is the master weights read
    # once from the memory-mapped files, about one parameter in flight and the tokenizer's conversion (1.37x), not
    # the whole state read, then its HF layout, then a weights file serialised in one buffer (2.4x)
    from bench.host_memory import measure

    model_cfg = dataclasses.replace(TINY.model, vocab_size=1100, d_model=256, d_ff=1024, num_heads=4, d_kv=64,
                                    num_layers=4, num_decoder_layers=4)
    cfg = dataclasses.replace(TINY, model=model_cfg, data=dataclasses.replace(TINY.data, tokenizer=tokenizer_model))
    run_distributed(_train_and_save, 1, str(tmp_path / "run"), to_yaml(cfg), model_cfg, 1, 1, "bf16")
    export = measure("export", tmp_path / "run", tmp_path / "export")
    assert export["model"] > 30e6
    assert export["peak"] - export["imports"] < 1.6 * export["model"], export


def test_incomplete_damaged_or_code_carrying_checkpoints_are_refused(tmp_path, saved_run):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir)
    ckpt = run_dir / "checkpoints" / "step_1"
    out = tmp_path / "export"

    def refused(match, step=1):
        with pytest.raises(CheckpointError, match=match):
            export(run_dir, out, step=step)
        assert not out.exists() and not (tmp_path / "export.tmp").exists()

    refused(r"step_7 not found; complete ones: step_1", step=7)
    optim = sorted(ckpt.glob("*optim_states.pt"))[-1]  # the last rank's shard
    saved = optim.read_bytes()
    optim.write_bytes(saved[: len(saved) // 2])  # a save cut short
    refused(rf"step_1 is incomplete: {optim.name} \({len(saved) // 2} of {len(saved)} bytes\)")
    refused(r"has no complete checkpoint", step=None)  # `latest` alone is not taken on trust
    optim.write_bytes(saved[:100] + bytes(len(saved) - 100))  # the right size, overwritten
    refused(rf"checkpoint .*step_1 is damaged: {optim.name} \(checksum mismatch\)")
    rank0 = sorted(ckpt.glob("*optim_states.pt"))[0]
    _overwrite_middle(rank0)  # 1000 floats of 1e4 in the middle of rank 0's optimizer shard, the size unchanged
    refused(rf"step_1 is damaged: {rank0.name} \(checksum mismatch\), {optim.name} \(checksum mismatch\)")
    optim.write_bytes(saved[:100] + bytes(len(saved) - 100))
    _with_size_listed(ckpt, optim)  # a damage the checksums cannot see: the unpickler names the file
    _with_size_listed(ckpt, rank0)
    refused(rf"{optim.name} is damaged")
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": _RunsCode(marker)}, optim)
    _with_size_listed(ckpt, optim)
    refused(rf"{optim.name} holds objects that are not tensors")
    assert not marker.exists()
    optim.unlink()
    refused(rf"is incomplete: {optim.name} \(missing\)")
    optim.write_bytes(saved)
    _with_size_listed(ckpt, optim)
    (ckpt / "complete.json").unlink()
    refused(r"step_1 is incomplete: complete.json")


def test_the_export_ships_the_tokenizer_the_model_was_trained_with(tmp_path, saved_run, tokenizer_model):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir)
    ckpt = run_dir / "checkpoints" / "step_1"
    assert (ckpt / "spiece.model").read_bytes() == Path(tokenizer_model).read_bytes()  # the checkpoint's copy
    # a checkpoint without its own copy (an older one) takes data.tokenizer, if it is the one recorded
    (ckpt / "spiece.model").unlink()
    marker = json.loads((ckpt / "complete.json").read_text())
    del marker["files"]["spiece.model"]
    (ckpt / "complete.json").write_text(json.dumps(marker))
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    other = tmp_path / "other.model"
    other.write_bytes(Path(tokenizer_model).read_bytes() + b"\0")  # another tokenizer at data.tokenizer's path
    config["data"]["tokenizer"] = str(other)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    _with_size_listed(ckpt, ckpt / "config.yaml")
    with pytest.raises(UsageError, match=rf"{other} is not the tokenizer the model was trained with \(sha256 "):
        export(run_dir, tmp_path / "export")


def test_an_export_into_the_runs_checkpoints_is_refused_in_one_line(tmp_path, tokenizer_model, capsys):
    # before, an export inside checkpoints/ was written, and a later save pruned or replaced it without a word
    from pretrain.export import main as export_main

    run_dir = _run(tmp_path, tokenizer_model, 1, 1, 1, False, "fp32")[0]
    (tmp_path / "exports").symlink_to(run_dir / "checkpoints")  # the same folder by another name
    for output in (run_dir / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_1" / "hf",
                   tmp_path / "exports" / "hf"):
        assert export_main(["--run", str(run_dir), "--output", str(output)]) == EXIT_USAGE
        assert capsys.readouterr().err == (
            f"python -m pretrain.export: error: --output {output} is inside {run_dir / 'checkpoints'}, whose folders "
            "the run's saves prune and replace; choose a folder outside it\n")
        assert not output.exists()


# the export's writing side as its command runs it (run_with_exit_codes), in a process whose disk is full
_EXPORT_TINY = """
import sys
from pathlib import Path
from pretrain.core.config import Config, load_config
from pretrain.transfer.exporting import write_export
from pretrain.runtime.faults import run_with_exit_codes
from pretrain.model import build_local_model
model = build_local_model(load_config(Config, "configs/tiny.yaml").model)
sys.exit(run_with_exit_codes(lambda: write_export(model, Path(sys.argv[1]), Path(sys.argv[2])), "pretrain.export"))
"""


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tokenizer_model):
    previous = write_export(build_local_model(TINY.model), Path(tokenizer_model), tmp_path / "previous")
    before = {f.name: f.read_bytes() for f in previous.iterdir()}
    (tmp_path / "export.tmp").mkdir()  # left by an export that was killed
    [(code, err)] = launch_like_srun(1, _EXPORT_TINY, [tokenizer_model, str(tmp_path / "export")], cwd=REPO,
                                     preexec_fn=disk_full)  # the 1.6 MB weights file stops at 1 MB
    assert code == EXIT_USAGE and "Traceback" not in err
    assert err.endswith(f"pretrain.export: error: writing the export {tmp_path / 'export'} failed (File too large); "
                        "is the disk full or over quota? nothing was written: free space or choose another --output\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]  # no export.tmp, no export
    assert {f.name: f.read_bytes() for f in previous.iterdir()} == before


def test_vanilla_export_is_plain_huggingface_t5(tmp_path, tokenizer_model):
    from transformers import T5ForConditionalGeneration, T5Tokenizer, T5TokenizerFast

    cfg = dataclasses.replace(TINY.model, encoder_attention="vanilla", decoder_attention="vanilla")
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    randomize_constant_parameters(ours)
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "t5" and "auto_map" not in config and not list(out.glob("*.py"))
    hf = AutoModelForSeq2SeqLM.from_pretrained(out).eval()  # no remote code needed
    assert type(hf) is T5ForConditionalGeneration
    _assert_same_as_ours(ours, hf)
    assert json.loads((out / "generation_config.json").read_text()) | {"transformers_version": None} == {
        "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "max_length": cfg.max_length,
        "transformers_version": None}
    assert config["tie_word_embeddings"] is False  # v1.1's own lm_head: transformers 4 ties and rescales on true
    assert "T5ForConditionalGeneration.from_pretrained" in (out / "README.md").read_text()
    text = "The quick brown fox <extra_id_0> over 12 lazy dogs."
    expected = Tokenizer(tokenizer_model).encode(text) + [1]
    for cls in (T5TokenizerFast, T5Tokenizer):
        assert cls.from_pretrained(out)(text).input_ids == expected


@pytest.mark.parametrize("position_bias", ["vanilla", "none"])
def test_a_vanilla_export_is_hf_t5_only_with_t5s_position_bias(tmp_path, tokenizer_model, position_bias):
    # position_bias vanilla: the same function as all for a vanilla model, so plain T5; none: T5 has no way to leave
    # its bias out (a missing relative_attention_bias is drawn fresh by from_pretrained), so the remote code
    cfg = dataclasses.replace(TINY.model, encoder_attention="vanilla", decoder_attention="vanilla",
                              position_bias=position_bias)
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    randomize_constant_parameters(ours)
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    if position_bias == "vanilla":
        assert config["model_type"] == "t5" and "auto_map" not in config
        hf = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    else:
        assert config["model_type"] == "synthesizer_t5" and config["position_bias"] == "none"
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            AutoModelForSeq2SeqLM.from_pretrained(out)
        hf = AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True).eval()
        assert not any("relative_attention_bias" in name for name, _ in hf.named_parameters())
    card = (out / "README.md").read_text()  # the card's loading code is the one that works for it
    assert ("trust_remote_code=True" in card) == (position_bias == "none")
    assert f"(`position_bias: {position_bias}`) |" in card
    _assert_same_as_ours(ours, hf)


def test_an_export_older_than_a_model_key_loads_with_the_keys_old_behaviour(tmp_path, tokenizer_model):
    from pretrain.core.config import MODEL_KEYS_ADDED
    from pretrain.model.hf_synthesizer.configuration_synthesizer_t5 import SYNTHESIZER_DEFAULTS
    from pretrain.model.pretrained import export_config

    # the remote code imports nothing of ours: its table of what a missing key means is checked against ours
    assert {k: SYNTHESIZER_DEFAULTS[k] for k in MODEL_KEYS_ADDED} == MODEL_KEYS_ADDED == {
        "position_bias": "all", "synthesizer_init": "t5"}
    cfg = dataclasses.replace(TINY.model, **MODEL_KEYS_ADDED)  # the shipped random+vanilla, as exports were made
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    randomize_constant_parameters(ours)
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    for key in MODEL_KEYS_ADDED:  # what an export written before the keys existed holds
        del config[key], config["synthesizer"]["model"][key]
    (out / "config.json").write_text(json.dumps(config))
    assert export_config(out) == cfg
    hf = AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True).eval()
    assert (hf.config.position_bias, hf.config.synthesizer_init) == ("all", "t5")
    _assert_same_as_ours(ours, hf)


def _in_a_canonical_order(spec: str) -> bool:
    """Whether the mixers of `spec` are in alphabetical or in MIXERS order (or the reverse of one)."""
    names = spec.split("+")
    orders = (sorted(names), sorted(names, key=list(MIXERS).index))
    return any(names in (order, order[::-1]) for order in orders)


# Mixture weight i belongs to the i-th mixer as the spec lists them: a mixer-order bug (sorting, or a canonical
# order, in the model, the export or the remote code) pairs weights and mixers differently and changes the
# logits, but only for a spec out of that order. So beside the shipped model, every mixture of three below is
# in no canonical order, in the encoder and the decoder, with weights per layer and per head. Each position_bias
# appears with a mixture of vanilla (where "vanilla" weighs the bias with q k^T) and a stack without vanilla.
# Every registered mixer is exported in an encoder and in a decoder (HF's cached generate).
REMOTE_CODE_CASES = [
    ("random+vanilla", "random+vanilla", False, "all"),  # the shipped tiny model
    ("dense", "factorized_random+fixed_random", True, "all"),  # no dot product anywhere; per-head mixture
    ("factorized_dense+vanilla+dense", "factorized_dense+vanilla+random", True, "all"),
    ("random+dense+factorized_random", "factorized_random+vanilla+fixed_random", False, "all"),
    ("random+vanilla", "dense+vanilla+random", True, "vanilla"),
    ("fixed_random", "vanilla+factorized_random", False, "vanilla"),
    ("random+vanilla", "random", False, "none"),
]


def test_the_remote_code_cases_name_every_registered_mixer_in_each_stack():
    assert_covers([encoder for encoder, *_ in REMOTE_CODE_CASES], "test_export.REMOTE_CODE_CASES's encoders")
    assert_covers([decoder for _, decoder, *_ in REMOTE_CODE_CASES], "test_export.REMOTE_CODE_CASES's decoders")


@pytest.mark.parametrize("encoder,decoder,per_head,position_bias", REMOTE_CODE_CASES)
def test_synthesizer_export_loads_in_huggingface_with_remote_code_only(tmp_path, tokenizer_model, encoder, decoder,
                                                                        per_head, position_bias):
    assert all(not _in_a_canonical_order(spec) for spec in (encoder, decoder) if spec.count("+") == 2)
    cfg = dataclasses.replace(TINY.model, encoder_attention=encoder, decoder_attention=decoder, mixture_per_head=per_head,
                              position_bias=position_bias)
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    randomize_constant_parameters(ours)  # norms, mixture logits, synthesizer biases: distinct, not 1 or 0
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "synthesizer_t5" and config["auto_map"]["AutoModelForSeq2SeqLM"]
    assert (config["encoder_attention"], config["decoder_attention"]) == (encoder, decoder)  # as written, in order
    assert config["position_bias"] == position_bias and config["synthesizer_init"] == cfg.synthesizer_init
    for name in ("configuration_synthesizer_t5.py", "modeling_synthesizer_t5.py"):
        source = (out / name).read_text()
        assert not any(line.startswith(("import pretrain", "from pretrain")) for line in source.splitlines())
    # without trust_remote_code: refused, never silently a plain T5 with the Synthesizer weights dropped
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForSeq2SeqLM.from_pretrained(out)
    hf = AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == "SynthesizerT5ForConditionalGeneration"
    _assert_same_as_ours(ours, hf)
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds synthesizer_length \(64\)"):
        hf(input_ids=torch.ones(1, 65, dtype=torch.long), decoder_input_ids=torch.zeros(1, 1, dtype=torch.long))


def test_pure_synthesizer_layers_round_trip(tmp_path, tokenizer_model):
    cfg = dataclasses.replace(TINY.model, encoder_attention="dense", decoder_attention="factorized_random+vanilla")
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    out = write_export(ours, Path(tokenizer_model), tmp_path / "export", dtype=torch.bfloat16)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    loaded = load_pretrained(out)
    for k, v in full_state_dict(ours).items():
        assert torch.equal(full_state_dict(loaded)[k], v.to(torch.bfloat16).float()), k
    with pytest.raises(ValueError, match="already exists"):
        write_export(ours, Path(tokenizer_model), out)
    # what fine-tuning and evaluation read is checked against the crc32s in config.json
    weights = (out / "model.safetensors").read_bytes()
    _overwrite_middle(out / "model.safetensors")
    with pytest.raises(UsageError, match=rf"export {out} is damaged: model.safetensors \(checksum mismatch\); export"):
        load_pretrained(out)
    (out / "model.safetensors").write_bytes(weights[:8] + b"x" * 32 + weights[40:])  # a header safetensors can't read
    with pytest.raises(UsageError, match=rf"export {out} is damaged: model.safetensors \(checksum mismatch\); export"):
        load_pretrained(out)
    (out / "model.safetensors").write_bytes(weights)
    (out / "spiece.model").unlink()  # HF's tokenizer.json stands in for it (a folder HF saved back has no other)
    load_pretrained(out)
    (out / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer: neither spiece.model nor HuggingFace's tokenizer.json"):
        load_pretrained(out)
