"""Evaluation as jobs run it: inputs follow the model's device (checked on the meta device, where a tensor left
on the CPU raises), DP 2 under ZeRO-3 with a dev set that splits unevenly gives the same predictions as one
process, inputs beyond a synthesized encoder's max_length are truncated (said once) instead of failing, and
progress is logged."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from pretrain.core.config import ModelConfig
from pretrain.model import build_local_model, full_state_dict, generate_greedy, load_full_state_dict
from pretrain.tasks import get_task
from pretrain.transfer.evaluation import encode_inputs, evaluate_task, input_limit, predict, write_results
from tests.distributed import run_distributed
from tokenizer.spm import Tokenizer

CFG = ModelConfig(vocab_size=1152, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                  max_length=16, factorized_k=3, relative_attention_num_buckets=8, relative_attention_max_distance=16)
SENTENCES = ["a charming and often affecting journey", "uneasy mishmash of styles and genres", "it is good",
             "the film is long, loud and not very funny at all", "a triumph"]  # 5: 3 + 2 at DP 2


def sst2_folder(root: Path) -> Path:
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    (folder / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(SENTENCES)))
    (folder / "test.tsv").write_text("index\tsentence\n" + "".join(f"{i}\t{s}\n" for i, s in enumerate(SENTENCES)))
    return folder


def eos_happy_model(cfg: ModelConfig):
    """A random model whose EOS (id 1) logit is raised, so batches (and DP ranks) finish decoding at different
    steps: with seed 0 (name-keyed initialisation), the batch of examples 0 and 2 decodes 3 steps, that of 1 and 3 two."""
    torch.manual_seed(0)
    model = build_local_model(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight[1] += 4.0
    return model


@pytest.mark.parametrize("encoder", ["vanilla", "random+vanilla"])
def test_every_path_runs_with_the_model_on_the_meta_device(tmp_path, tokenizer_model, encoder):
    model = build_local_model(dataclasses.replace(CFG, encoder_attention=encoder, decoder_attention=encoder)).eval()
    model.to("meta")
    task, tokenizer = get_task("sst2"), Tokenizer(tokenizer_model)
    examples = task.read(sst2_folder(tmp_path), "dev.tsv", labelled=True)
    preds = predict(model, tokenizer, task, examples, "both", batch_size=2, max_input_length=16)
    assert len(preds["generate"]) == len(preds["rank"]) == len(examples)  # values on meta mean nothing


def test_evaluate_job_runs_on_the_requested_device(tmp_path, tokenizer_model):
    from pretrain.evaluate import main
    from pretrain.transfer.exporting import write_export

    export = write_export(build_local_model(CFG), Path(tokenizer_model), tmp_path / "export")
    folder = sst2_folder(tmp_path / "glue")
    main(["--export", str(export), "--task", "sst2", "--data", str(folder), "--output", str(tmp_path / "out"),
          "--device", "meta", "--batch", "2"])
    assert (tmp_path / "out" / "results.json").is_file() and (tmp_path / "out" / "submission" / "SST-2.tsv").is_file()


def test_a_limited_evaluation_says_what_it_covers_and_names_its_submission_partial(tmp_path, tokenizer_model):
    # before: results.json held the scores of 2 examples as the task's, and submission/SST-2.tsv held 2 rows
    from pretrain.evaluate import main
    from pretrain.transfer.exporting import write_export

    export = write_export(build_local_model(CFG), Path(tokenizer_model), tmp_path / "export")
    main(["--export", str(export), "--task", "sst2", "--data", str(sst2_folder(tmp_path / "glue")), "--output",
          str(tmp_path / "out"), "--device", "meta", "--batch", "2", "--limit", "2"])
    scores = json.loads((tmp_path / "out" / "results.json").read_text())["sst2"]
    assert (scores["examples"], scores["examples_in_file"]) == (2, 5)
    assert sorted(p.name for p in (tmp_path / "out" / "submission").iterdir()) == ["SST-2.partial-2-of-5.tsv"]
    assert len((tmp_path / "out" / "submission" / "SST-2.partial-2-of-5.tsv").read_text().splitlines()) == 3
    assert "| sst2 (2 of 5 examples) |" in (tmp_path / "out" / "results.md").read_text()


def test_an_undefined_correlation_is_written_as_such(tmp_path):
    # a constant STS-B prediction: pearson was 0.0, a score; now NaN in results.json, "undefined" in results.md
    write_results(tmp_path, {"stsb": {"pearson": math.nan, "spearman": math.nan, "examples": 5, "examples_in_file": 5}})
    assert math.isnan(json.loads((tmp_path / "results.json").read_text())["stsb"]["pearson"])
    assert "| stsb | undefined | undefined |" in (tmp_path / "results.md").read_text()


def test_synthesized_encoder_truncates_long_inputs_once(tmp_path, tokenizer_model, caplog):
    caplog.set_level(logging.INFO, logger="pretrain")
    cfg = dataclasses.replace(CFG, encoder_attention="dense+vanilla")
    assert input_limit(dataclasses.replace(cfg, encoder_attention="vanilla"), 128) == 128  # vanilla has no limit
    model, tokenizer, task = eos_happy_model(cfg), Tokenizer(tokenizer_model), get_task("sst2")
    examples = task.read(sst2_folder(tmp_path), "dev.tsv", labelled=True)
    assert max(len(ids) for ids in tokenizer.encode_batch([e.inputs for e in examples])) > CFG.max_length
    capped = predict(model, tokenizer, task, examples, "both", batch_size=2, max_input_length=128)
    again = predict(model, tokenizer, task, examples, "both", batch_size=2, max_input_length=128)
    assert capped == again == predict(model, tokenizer, task, examples, "both", 2, max_input_length=CFG.max_length)
    assert [r.getMessage()[:36] for r in caplog.records if r.name == "pretrain.core.progress"][:2] == [
        "sst2 both: batches:   0%|          |", "sst2 both: batches: 100%|##########|"]  # 3 batches, progress
    said = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert said == ["inputs are truncated to 16 tokens, the model.max_length of its synthesized encoder attention "
                    "(128 requested)"]


def decoding_steps(model, tokenizer: Tokenizer, rows: list[int]) -> int:
    batch = encode_inputs(tokenizer, [f"sst2 sentence: {SENTENCES[i]}" for i in rows], max_length=16)
    return generate_greedy(model, batch.input_ids, batch.attention_mask, max_new_tokens=3).shape[1]


def _zero3_evaluate(rank, world, state, cfg, folder, tokenizer_model):
    from pretrain.core.config import ParallelConfig, TrainConfig, ZeroConfig
    from pretrain.distributed.parallel import init_distributed
    from pretrain.model import build_model
    from pretrain.runtime.engine import build_engine

    # a rank that runs a forward the other does not waits in ZeRO-3's parameter all-gather: fail in 60 s, not hang
    init_distributed(ParallelConfig(tensor=1, backend="gloo", timeout_s=60), seed=0)
    model = build_model(cfg)
    load_full_state_dict(model, state)
    engine = build_engine(model, TrainConfig(micro_batch=1, global_batch=2), ZeroConfig(stage=3), "fp32", dp=2)
    assert engine.zero_optimization_stage() == 3
    submission = Path(folder).parent / f"submission-dp{rank}"
    results = evaluate_task(engine.module, Tokenizer(tokenizer_model), get_task("sst2"), folder, "both",
                            batch_size=2, max_input_length=16, submission_dir=submission)
    return results, (submission / "SST-2.tsv").read_text() if rank == 0 else None


def test_zero3_evaluation_at_dp2_matches_one_process(tmp_path, tokenizer_model):
    reference_model = eos_happy_model(CFG)
    folder = sst2_folder(tmp_path)
    task, tokenizer = get_task("sst2"), Tokenizer(tokenizer_model)
    # the first batches of DP rank 0 (examples 0, 2) and rank 1 (1, 3) decode for different numbers of steps
    assert decoding_steps(reference_model, tokenizer, [0, 2]) != decoding_steps(reference_model, tokenizer, [1, 3])
    expected = evaluate_task(reference_model, tokenizer, task, folder, "both", batch_size=2, max_input_length=16,
                             submission_dir=tmp_path / "submission-reference")
    (r0, predictions), (r1, _) = run_distributed(_zero3_evaluate, 2, full_state_dict(reference_model), CFG,
                                                 str(folder), tokenizer_model)
    assert r0 == r1 == expected
    assert predictions == (tmp_path / "submission-reference" / "SST-2.tsv").read_text()
    assert len(predictions.splitlines()) == 1 + len(SENTENCES)
