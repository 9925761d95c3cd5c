"""Pairing in the study: the pretraining jobs of one seed, whatever their variant, read the same batches in the
same order and start with the same values in every parameter they share (the cells' own arguments, parsed as
the trainer parses them)."""
from __future__ import annotations

import itertools

import torch
import yaml

from pretrain.core.config import Config, load_config
from pretrain.data.loader import build_train_loader
from pretrain.experiments.grid import StudyConfig, cells, pretrain_args
from pretrain.model import build_local_model
from tests.conftest import PreparedData

SPECS = ["vanilla", "random", "random+vanilla", "dense+vanilla"]
ABLATION = "random(position_bias=none)"  # a variant with a model setting of its own pairs like the others


def _job_configs(shards: PreparedData, tmp_path) -> dict[tuple[str, int], Config]:
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({
        "study": {"dir": str(tmp_path), "seeds": [1, 2], "variants": [
            *({"encoder": s, "decoder": s} for s in SPECS),
            {"encoder": "random", "decoder": "random", "model": ["position_bias=none"]}]},
        "data": {"fetch": False, "train": shards.train, "valid": shards.valid, "tokenizer": shards.tokenizer},
        "pretrain": {"config": "configs/tiny.yaml", "overrides": ["data.workers=0"]}}))
    study = load_config(StudyConfig, tmp_path / "study.yaml")
    out = {}
    for cell in cells(study):
        args = pretrain_args(study, cell)
        assert args[0] == "--config"
        out[cell.variant.label, cell.seed] = load_config(Config, args[1], args[2:])
    return out


def _first_batches(cfg: Config, n: int = 3) -> list[dict]:
    loader = build_train_loader(cfg.data, seed=cfg.run.seed, dp_rank=0, dp_size=1, micro_batch=cfg.train.micro_batch)
    try:
        return list(itertools.islice(iter(loader), n))
    finally:
        loader.close()


def _initial(cfg: Config) -> dict[str, torch.Tensor]:
    torch.manual_seed(cfg.run.seed)  # as the trainer's init_distributed(seed) does before building the model
    model = build_local_model(cfg.model)
    return {name: p.detach() for name, p in model.named_parameters()}


def test_cells_of_one_seed_share_data_order_and_initial_values(shards: PreparedData, tmp_path):
    configs = _job_configs(shards, tmp_path)
    for seed in (1, 2):
        batches = {spec: _first_batches(configs[spec, seed]) for spec in ("vanilla", "random", ABLATION)}
        for other in ("random", ABLATION):
            for a, b in zip(batches["vanilla"], batches[other]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert configs[ABLATION, seed].model.position_bias == "none" and configs["random", seed].model.position_bias == "all"
        params = {spec: _initial(configs[spec, seed]) for spec in [*SPECS, ABLATION]}
        for spec in [*SPECS[1:], ABLATION]:
            shared = params["vanilla"].keys() & params[spec].keys()
            assert "decoder.layers.1.ffn.wo.weight" in shared and "embed.weight" in shared
            assert all(torch.equal(params["vanilla"][k], params[spec][k]) for k in shared), spec
    # and the seeds differ: the pairing is within a seed
    assert not torch.equal(_first_batches(configs["vanilla", 1])[0]["labels"],
                           _first_batches(configs["vanilla", 2])[0]["labels"])
    assert not torch.equal(_initial(configs["vanilla", 1])["embed.weight"],
                           _initial(configs["vanilla", 2])["embed.weight"])
