"""Pretraining from a HuggingFace T5 folder (`init=PATH`): a random-weight `T5ForConditionalGeneration` saved with
`save_pretrained` starts a 1-step run whose learning rate is too small to move a weight, so the run's export
must hold HF's tensors exactly: vanilla at TP 1 and TP 2, a sharded save, and `random+vanilla` (the T5 parts
loaded, the Synthesizer parts drawn from the run's seed). A vocabulary of another size is refused; a requeued
run resumes its own checkpoint instead of starting from init again."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import T5ForConditionalGeneration

from pretrain.core.config import Config, load_config
from pretrain.model import build_local_model, full_state_dict
from pretrain.model.hf_convert import hf_config
from pretrain.model.pretrained import weight_files
from pretrain.transfer.exporting import export
from tests.distributed import run_distributed
from tests.test_hf_parity import randomize_constant_parameters
from tests.test_train import TINY, _train_each, data_overrides

MODEL = load_config(Config, TINY).model
VANILLA = ["model.encoder_attention=vanilla", "model.decoder_attention=vanilla"]
# one step that moves no weight: AdamW's first update is about lr (x warmup 1/10), far below an fp32 ulp
ONE_STEP = ["train.steps=1", "train.lr=1e-20", "log.every=1", "eval.every=0", "checkpoint.every=0"]


def _hf_folder(path: Path, vocab_size: int = MODEL.vocab_size, **save) -> Path:
    """A T5 v1.1 with random weights (norms too; lm_head apart from the embedding), saved as HF saves it."""
    torch.manual_seed(3)
    cfg = dataclasses.replace(MODEL, vocab_size=vocab_size, encoder_attention="vanilla", decoder_attention="vanilla")
    hf = T5ForConditionalGeneration(hf_config(cfg))
    hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight))
    randomize_constant_parameters(hf)
    hf.save_pretrained(path, **save)
    return path


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in weight_files(folder) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def init_runs(shards, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("init")
    hf, sharded = _hf_folder(tmp / "hf"), _hf_folder(tmp / "hf_sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    data = data_overrides(shards)
    runs = {"tp1": [*VANILLA, f"init={hf}"], "sharded": [*VANILLA, f"init={sharded}"],
            "random": [f"init={hf}"], "random_again": [f"init={hf}"]}
    tp1 = [(str(tmp / name), [*data, *ONE_STEP, *extra], None) for name, extra in runs.items()]
    wrong_vocab = [(str(tmp / "vocab"), [*data, *ONE_STEP, *VANILLA, f"init={_hf_folder(tmp / 'hf1200', 1200)}"],
                    None)]
    requeue = [(str(tmp / "tp1"), [*data, *ONE_STEP, *VANILLA, f"init={hf}", "train.steps=2"], None)]
    codes = run_distributed(_train_each, 1, tp1 + wrong_vocab + requeue)[0]
    assert codes[:4] == [0] * 4 and codes[5] == 0, codes
    runs = {name: tmp / name for name in [*runs, "vocab"]}
    runs["refusal"] = codes[4]
    runs["tp2"] = tmp / "tp2"
    assert run_distributed(_train_each, 2, [(str(runs["tp2"]), [*data, *ONE_STEP, *VANILLA, "parallel.tensor=2",
                                                                f"init={hf}"], None)]) == [[0]] * 2
    for name in ("tp1", "sharded", "random", "random_again", "tp2"):
        export(runs[name], tmp / f"{name}_export", step=1)
    runs["hf"] = hf
    return runs


@pytest.mark.parametrize("run", ["tp1", "tp2", "sharded"])
def test_a_vanilla_run_starts_from_the_hf_weights(init_runs, run):
    expected = _tensors(init_runs["hf"])
    exported = _tensors(init_runs[run].with_name(f"{run}_export"))
    assert set(expected) <= set(exported)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    report = json.loads((init_runs[run] / "init.json").read_text())
    assert report["fresh"] == [] and report["unused"] == [] and len(report["loaded"]) == len(list(
        build_local_model(dataclasses.replace(MODEL, encoder_attention="vanilla", decoder_attention="vanilla"))
        .parameters()))


def test_random_vanilla_loads_the_t5_parts_and_draws_the_synthesizer_parts_from_the_seed(init_runs):
    expected = _tensors(init_runs["hf"])
    exported = _tensors(init_runs["random"].with_name("random_export"))
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    report = json.loads((init_runs["random"] / "init.json").read_text())
    assert {n.rsplit(".", 1)[-1] for n in report["fresh"]} == {"mix", "r"}  # attn.mix, attn.synth.random.r
    assert len(report["fresh"]) == 2 * (MODEL.num_layers + MODEL.num_decoder_layers)
    # the Synthesizer parts are the run's seed's draw: the same in a second run, and what a model built from
    # that seed holds (every parameter is drawn in order, loaded ones too, so the streams stay aligned)
    again = _tensors(init_runs["random_again"].with_name("random_again_export"))
    torch.manual_seed(load_config(Config, TINY).run.seed)
    drawn = full_state_dict(build_local_model(MODEL))
    for ours in report["fresh"]:
        layer = ours.split(".attn.")
        hf_name = layer[0].replace("layers", "block") + ".layer.0.SelfAttention." + layer[1]
        # (the zero-initialised mixture logits do move, by lr = 1e-21)
        assert torch.equal(exported[hf_name], again[hf_name]), ours
        assert torch.allclose(exported[hf_name], drawn[ours], rtol=0, atol=1e-18), ours


def test_a_vocabulary_of_another_size_is_refused(init_runs):
    assert init_runs["refusal"].startswith(f"{init_runs['vocab'].with_name('hf1200')} has 1200 token rows")
    assert "init_resize_vocab=true" in init_runs["refusal"]


def test_a_requeued_run_resumes_its_own_checkpoint_not_init(init_runs):
    steps = [json.loads(line)["step"] for line in (init_runs["tp1"] / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the second start continued from step_1 rather than starting over from init


def test_init_folders_of_another_function_or_vocabulary_are_refused(tmp_path, tokenizer_model):
    from pretrain.core.config import UsageError
    from pretrain.model.pretrained import check_init_folder

    folder = _hf_folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    check_init_folder(folder, MODEL, Path(tokenizer_model), resize_vocab=False)  # no spiece.model: nothing to compare
    for key, value, match in [("feed_forward_proj", "relu", "feed_forward_proj 'relu'.*T5 v1.0"),
                              ("relative_attention_max_distance", 128,
                               "relative_attention_max_distance 128, the model 32: set model.relative_attention_max_distance=128")]:
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(UsageError, match=match):
            check_init_folder(folder, MODEL, Path(tokenizer_model), resize_vocab=False)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "spiece.model").write_bytes(b"another vocabulary")
    with pytest.raises(UsageError, match="spiece.model is not data.tokenizer"):
        check_init_folder(folder, MODEL, Path(tokenizer_model), resize_vocab=False)
    check_init_folder(folder, MODEL, Path(tokenizer_model), resize_vocab=True)  # knowingly another vocabulary


def test_a_folder_of_another_width_is_refused_naming_the_first_tensor_and_both_shapes(tmp_path):
    # before: 10 tensors loaded (norms, biases), 36 fresh: every real weight started fresh, exit 0
    from pretrain.core.config import UsageError
    from pretrain.model.pretrained import load_weights

    folder = _hf_folder(tmp_path / "hf")  # width 64
    wider = dataclasses.replace(MODEL, d_model=128, encoder_attention="vanilla", decoder_attention="vanilla")
    with pytest.raises(UsageError) as e:
        load_weights(build_local_model(wider), folder, resize_vocab=True)  # the resize allows rows, not widths
    assert str(e.value) == (f"init={folder} holds shared.weight of shape [1100, 64], the model's embed.weight is "
                            "[*, 128] (any number of rows): set the model.* keys to the folder's config.json (the "
                            "first tensor of another shape; none is loaded)")
    heads = dataclasses.replace(MODEL, num_heads=2, encoder_attention="vanilla", decoder_attention="vanilla")
    with pytest.raises(UsageError, match=r"holds encoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias"
                                         r"\.weight of shape \[4, 8\], the model's encoder\.relative_bias\.weight is "
                                         r"\[2, 8\]: set"):
        load_weights(build_local_model(heads), folder)


def _count_reads(rank, world, runs):
    """_train_each with the weights folder's reads counted: the folders indexed (their files' headers) and each
    tensor read, in this process."""
    from collections import Counter

    from pretrain.model.pretrained import WeightFolder

    folders, tensors = Counter(), Counter()
    index, read = WeightFolder.__init__, WeightFolder.read

    def counted_index(self, folder):
        folders[str(folder)] += 1
        index(self, folder)

    def counted_read(self, name):
        tensors[name] += 1
        return read(self, name)

    WeightFolder.__init__, WeightFolder.read = counted_index, counted_read
    try:
        return _train_each(rank, world, runs), dict(folders), dict(tensors)
    finally:
        WeightFolder.__init__, WeightFolder.read = index, read


def test_a_bf16_run_reads_its_init_folder_once_and_starts_its_master_weights_from_it(shards, tmp_path):
    # the skeleton reads init= once, into the module and its fp32 master copy (before: the module's load, then a
    # second read of the whole folder for the master copy, which DeepSpeed builds from the bf16 cast)
    hf = _hf_folder(tmp_path / "hf")
    overrides = [*data_overrides(shards), *ONE_STEP, *VANILLA, f"init={hf}", "precision=bf16",
                 "parallel.backend=gloo"]
    codes, folders, tensors = run_distributed(_count_reads, 1, [(str(tmp_path / "run"), overrides, None)])[0]
    assert codes == [0]
    assert folders == {str(hf): 1}
    expected = _tensors(hf)
    assert tensors == {name: 1 for name in expected if not name.endswith("embed_tokens.weight")}
    # the master copy holds the folder's fp32 values, which bf16 cannot: the run's export (of the master copy) too
    exported = _tensors(export(tmp_path / "run", tmp_path / "export", step=1))
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
