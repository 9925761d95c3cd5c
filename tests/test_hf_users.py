"""What a HuggingFace user does with an export, tried with HF's own classes: load it in transformers 4.57 (the last
4.x, in conftest's second environment) and in the pinned 5.x with the same logits (ours), greedy tokens and token
ids; length limits where HF looks; resize_token_embeddings keeping the trained lm_head; a model card whose
pipeline tag is a task transformers has, whose pretraining accuracy says what it is and which gives fine-tuning's
dropout; and a folder HF saved back (save_pretrained, as a Trainer's save_model does) read by our jobs.
Constant parameters are randomised, so a swapped mapping shows."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForSeq2SeqLM, T5TokenizerFast, pipeline

from pretrain.core.config import Config, load_config
from pretrain.model import build_local_model, generate_greedy
from pretrain.transfer.exporting import load_pretrained, write_export
from pretrain.transfer.model_card import FINE_TUNING_DROPOUT, PIPELINE_TAG, UNTIE, model_card
from tests.hf_probe import TEXT, batch
from tests.test_hf_parity import randomize_constant_parameters
from tokenizer.spm import Tokenizer

TINY = load_config(Config, "configs/tiny.yaml")
PROBE = Path(__file__).with_name("hf_probe.py")
EXPORTS = {  # name (a folder, so a Python identifier for HF's remote-code modules): (encoder, decoder, per head,
    # position_bias)
    "vanilla": ("vanilla", "vanilla", False, "all"),
    "mixture": ("random+vanilla", "random+vanilla", False, "all"),  # the shipped tiny model
    "no_dot_product": ("dense", "factorized_random+fixed_random", True, "all"),  # the cache holds values as keys
    # transformers 4 folds the mask into the bias it hands the later layers; "vanilla" keeps them apart
    "bias_on_vanilla": ("random+vanilla", "dense+vanilla", False, "vanilla"),
    "no_bias": ("vanilla", "vanilla", False, "none"),  # not HF's T5: the remote code
}


def _export(folder: Path, tokenizer_model: str, encoder: str, decoder: str, per_head: bool, position_bias: str):
    cfg = dataclasses.replace(TINY.model, encoder_attention=encoder, decoder_attention=decoder,
                              mixture_per_head=per_head, position_bias=position_bias)
    torch.manual_seed(0)
    ours = build_local_model(cfg).eval()
    randomize_constant_parameters(ours)
    return ours, write_export(ours, Path(tokenizer_model), folder)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tokenizer_model) -> dict:
    """name -> (our model, its export folder)."""
    root = tmp_path_factory.mktemp("exports")
    return {name: _export(root / name, tokenizer_model, *spec) for name, spec in EXPORTS.items()}


def _probe(python: Path | str, folders: list[Path], out: Path) -> dict:
    done = subprocess.run([str(python), str(PROBE), str(out), UNTIE, *map(str, folders)], capture_output=True,
                          text=True, cwd=out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_exports_load_alike_in_transformers_4_and_5(exports, transformers4_python, tmp_path, tokenizer_model):
    folders = [folder for _, folder in exports.values()]
    found = {result.pop("version"): result for result in (_probe(sys.executable, folders, tmp_path / "5.pt"),
                                                           _probe(transformers4_python, folders, tmp_path / "4.pt"))}
    assert set(found) == {"4.57.6", transformers.__version__}
    ids, mask, dec = batch()
    expected_ids = Tokenizer(tokenizer_model).encode(TEXT) + [1]
    for name, (ours, folder) in exports.items():
        with torch.no_grad():
            logits = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[..., :1100]
        greedy = generate_greedy(ours, ids, mask, max_new_tokens=12)
        for version, results in found.items():
            got = results[str(folder)]
            error = ((got["logits"] - logits).abs().max() / logits.abs().max()).item()
            assert error < 1e-5, (name, version, error)
            assert torch.equal(got["greedy"][:, 1:], greedy), (name, version)  # HF keeps the start token
            for cls in ("AutoTokenizer", "T5TokenizerFast", "T5Tokenizer"):
                assert got[cls] == expected_ids, (name, version, cls)
                assert got[f"{cls}.model_max_length"] == got[f"{cls}.truncated"] == TINY.model.max_length
            assert got["generation_max_length"] == TINY.model.max_length, (name, version)
            assert got["lm_head_kept"], (name, version)


def test_length_limits_are_where_huggingface_looks(exports):
    _, folder = exports["mixture"]
    n = TINY.model.max_length
    tokenizer = T5TokenizerFast.from_pretrained(folder)
    ids = tokenizer([TEXT * 20], truncation=True, return_tensors="pt").input_ids
    assert ids.shape[1] == n  # not 157 ids that the model refuses
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    # no EOS allowed: generation runs to the limit and stops there, instead of past N into the model's refusal
    out = hf.generate(input_ids=ids, suppress_tokens=[1], do_sample=False)
    assert out.shape[1] == n


@pytest.mark.parametrize("name", list(EXPORTS))
def test_automodel_gives_the_encoder_decoder_without_the_lm_head(exports, name):
    # what HF users reach for beside AutoModelForSeq2SeqLM: AutoModel, as T5Model is for a T5 checkpoint (was, for a
    # Synthesizer export: "Unrecognized configuration class ... for this kind of AutoModel")
    ours, folder = exports[name]
    hf = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(hf).__name__ == ("T5Model" if name == "vanilla" else "SynthesizerT5Model") and not hasattr(hf, "lm_head")
    ids, mask, dec = batch()
    with torch.no_grad():
        hidden = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state
    # our LM head on HF's decoder output gives our logits: the same encoder-decoder, every layer's mixers included
    _assert_lm_head_gives_our_logits(ours, hidden, name)


def _assert_lm_head_gives_our_logits(ours, hidden: torch.Tensor, name: str) -> None:
    ids, mask, dec = batch()
    with torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[..., :1100]
    again = hidden @ ours.lm_head.weight[:1100].T
    assert ((again - logits).abs().max() / logits.abs().max()).item() < 1e-5, name


AUTOMODEL_4 = """import sys, torch, transformers
from transformers import AutoModel
sys.path.insert(0, sys.argv[1])
from hf_probe import batch
ids, mask, dec = batch()
found = {}
for folder in sys.argv[3:]:
    hf = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        found[folder] = (type(hf).__name__, hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state)
torch.save({"version": transformers.__version__, **found}, sys.argv[2])
"""


def test_automodel_in_transformers_4(exports, transformers4_python, tmp_path):
    out = tmp_path / "automodel4.pt"
    folders = [str(folder) for _, folder in exports.values()]
    done = subprocess.run([str(transformers4_python), "-c", AUTOMODEL_4, str(PROBE.parent), str(out), *folders],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    found = torch.load(out, weights_only=True)
    assert found.pop("version") == "4.57.6"
    for name, (ours, folder) in exports.items():
        kind, hidden = found[str(folder)]
        assert kind == ("T5Model" if name == "vanilla" else "SynthesizerT5Model"), name
        _assert_lm_head_gives_our_logits(ours, hidden, name)


@pytest.mark.parametrize("name", ["vanilla", "mixture"])
def test_resize_token_embeddings_keeps_the_trained_lm_head(exports, name):
    ours, folder = exports[name]
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    card = (folder / "README.md").read_text()
    if name == "vanilla":  # transformers 5 ties plain T5's lm_head on resize: the card says what to run first
        assert UNTIE in card
        exec(UNTIE, {"model": hf})  # the card's line, run as a user runs it on their `model`
    else:  # our remote-code class keeps lm_head out of the tied weights by itself
        assert UNTIE not in card
    ids, mask, dec = batch()
    with torch.no_grad():
        before = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    hf.resize_token_embeddings(1110)
    hf.tie_weights()
    assert hf.lm_head.weight is not hf.shared.weight
    with torch.no_grad():
        after = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    assert after.shape[-1] == 1110 and ((after[..., :1100] - before).abs().max() / before.abs().max()).item() < 1e-6


def test_the_model_card_names_an_existing_task_pretraining_scores_and_fine_tuning_dropout(exports):
    from transformers.pipelines import REMOVED_TASKS, SUPPORTED_TASKS

    for name, (ours, folder) in exports.items():
        card = (folder / "README.md").read_text()
        assert f"pipeline_tag: {PIPELINE_TAG}\n" in card
        assert f"dropout_rate={FINE_TUNING_DROPOUT})`" in card and f"`dropout_rate` is {ours.config.dropout}" in card
    assert PIPELINE_TAG in SUPPORTED_TASKS and PIPELINE_TAG not in REMOVED_TASKS
    prompt = "sst2 sentence: a gorgeous film"
    _, folder = exports["vanilla"]
    assert pipeline(PIPELINE_TAG, model=str(folder))(prompt, max_new_tokens=4)[0]["generated_text"].startswith(prompt)
    _, folder = exports["mixture"]  # remote code: the pipeline looks for a causal LM in auto_map, so given the model
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
    generator = pipeline(PIPELINE_TAG, model=model, tokenizer=T5TokenizerFast.from_pretrained(folder))
    assert generator(prompt, max_new_tokens=4)[0]["generated_text"].startswith(prompt)
    # pretraining's token accuracy is said to be that, apart from the tasks' scores
    scores = {"eval_accuracy": 0.31, "eval_loss": 3.2, "sst2/accuracy": 0.6}
    card = model_card(TINY.model, 1, {}, {"evaluation": scores}, "export")
    assert ("Pretraining, on the held-out shards (data.valid): span-corruption targets, teacher-forced." in card
            and "| eval_accuracy | 0.31 | share of target tokens whose argmax is right: a pretraining measure, not a "
                "task score |" in card)
    assert "Fine-tuned tasks (the run's results.json):" in card and "| sst2/accuracy | 0.6 |" in card
    # the stated fine-tuning value is one from_pretrained takes
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, dropout_rate=FINE_TUNING_DROPOUT)
    assert hf.config.dropout_rate == FINE_TUNING_DROPOUT and hf.encoder.dropout.p == FINE_TUNING_DROPOUT


@pytest.mark.parametrize("name", ["vanilla", "mixture"])
def test_a_folder_huggingface_saved_back_loads_in_our_jobs(exports, tmp_path, name):
    # what a Trainer's save_model writes: model.save_pretrained + the tokenizer's save_pretrained, no spiece.model
    ours, folder = exports[name]
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(1.5)  # a fine-tuning moved it
    saved = tmp_path / "saved"
    hf.save_pretrained(saved)
    T5TokenizerFast.from_pretrained(folder).save_pretrained(saved)
    assert not (saved / "spiece.model").exists() and (saved / "tokenizer.json").is_file()
    model = load_pretrained(saved)
    ids, mask, dec = batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[..., :1100]
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    assert Tokenizer(saved).encode_batch([TEXT, "sst2 sentence: a gorgeous film"]) == \
        Tokenizer(folder).encode_batch([TEXT, "sst2 sentence: a gorgeous film"])
    assert json.loads((saved / "config.json").read_text())["synthesizer"]["files"]  # the export's, not these files'
