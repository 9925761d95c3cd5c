"""Corpus mixtures (`data.sources`): the schedule's realised shares, one global order on every layout with 2 and 3
sources, a small source repeating with its epochs counted, resume refused or reweighted, each bad input one line,
and requeues on DP 2 -> 1 -> 4 through the trainer equal to the uninterrupted run.

The sources are the fixture's 8 train shards split in two by brace patterns, and a third, small one: four shards of
~10 chunks each written here from real documents, so that it runs out within a few hundred examples."""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pretrain.core.config import Config, ConfigError, SourceConfig, UsageError, load_config, parse_args
from pretrain.data.loader import build_train_loader
from pretrain.data.sources import Schedule, lane_examples
from pretrain.data.stream import examples, start_position
from tests.test_loader import _write_shard, global_examples, tar_documents, uncorrupt
from tests.test_metrics import read_metrics, read_tensorboard

TINY = "configs/tiny.yaml"
# every prefix of n examples holds n x w_k of source k within this many examples (measured: 3.5 at most over the
# first 10^6 examples for 2, 3 and 16 sources; i.i.d. draws are off by ~150 at 10^5 for 0.7 / 0.3)
PREFIX_BOUND = 3.5
LANE_BOUND = 50  # the same within each lane's own sub-sequence, in lane examples (S = 8, 64, 89, 96 measured)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)])
def test_the_schedule_realises_the_weights_at_every_prefix(weights):
    n = 100_000
    for seed in (0, 1234):
        schedule = Schedule.of(seed, weights)
        source = schedule.sources(np.arange(n))
        for k, w in enumerate(weights):
            realised = np.cumsum(source == k)
            assert np.abs(realised - w * np.arange(1, n + 1)).max() <= PREFIX_BOUND, (seed, k)
            for lanes in (4, 64):  # each lane's streams of source k advance at its weight's pace too
                on_lane = np.cumsum(source[3::lanes] == k)
                assert np.abs(on_lane - w * np.arange(1, len(on_lane) + 1)).max() <= LANE_BOUND
        assert schedule.counts(0, n).tolist() == np.bincount(source, minlength=len(weights)).tolist()
        assert schedule.counts(777, 1234).tolist() == np.bincount(source[777:1234], minlength=len(weights)).tolist()
    assert (Schedule.of(0, (1.0,)).sources(np.arange(1000)) == 0).all()  # data.train: one source


@pytest.fixture(scope="module")
def small_source(shards, tmp_path_factory) -> str:
    """Four shards of ~10 chunks (70 tokens) each, from real documents of the fixture's first shard."""
    folder = tmp_path_factory.mktemp("small-source")
    docs = tar_documents(Path(shards.train, "shard-000000.tar"))
    for i in range(4):
        _write_shard(folder / f"shard-{i:06d}.tar", [list(d[:140]) for d in docs[5 * i : 5 * i + 5]])
    return str(folder)


def mixture(shards, small_source: str | None = None, weights=(0.7, 0.3), **overrides):
    """The fixture's shards as sources a (shards 0-3) and b (4-7), and c (`small_source`) when given: 4 streams."""
    parts = [("a", f"{shards.train}/shard-{{000000..000003}}.tar"),
             ("b", f"{shards.train}/shard-{{000004..000007}}.tar")]
    parts += [("c", small_source)] if small_source else []
    sources = [SourceConfig(name, train, w) for (name, train), w in zip(parts, weights)]
    return shards.config(train="", sources=sources, **{"streams": 4, **overrides})


@pytest.mark.parametrize("num_sources", [2, 3])
def test_global_batches_are_the_same_at_any_dp_size_micro_batch_and_workers(shards, small_source, num_sources):
    # 30 global batches of 8: the small source runs out (~10 chunks a stream per epoch) and its streams read on into
    # their next epochs inside their first block (64 chunks)
    weights = (0.5, 0.3, 0.2) if num_sources == 3 else (0.7, 0.3)
    cfg = lambda workers: mixture(shards, small_source if num_sources == 3 else None, weights, workers=workers)
    reference, state = global_examples(cfg(0), [(1, 8, 30)])
    assert len(set(reference)) == len(reference) == 240
    assert list(state["ranks"][0]["counts"].values()) == Schedule.of(3, weights).counts(0, 240).tolist()
    for workers, (dp, micro) in [(1, (2, 4)), (2, (2, 1)), (3, (1, 3)), (0, (4, 2)), (1, (4, 1)), (2, (2, 5)),
                                 (3, (2, 6)), (2, (1, 8))]:
        got, _ = global_examples(cfg(workers), [(dp, micro, 30)])
        assert got == reference, (workers, dp, micro)
    # a requeue on 2, then 1, then 4 ranks continues with the next example
    first, state = global_examples(cfg(1), [(2, 4, 7)])
    second, state = global_examples(cfg(3), [(1, 2, 10)], state=state)
    third, state = global_examples(cfg(2), [(4, 1, 13)], state=state)
    assert first + second + third == reference


def test_within_a_source_examples_follow_its_streams(shards, small_source):
    # lane s's examples of source k, in order, are stream s of source k read on its own: nothing skipped or repeated
    loader = build_train_loader(mixture(shards, small_source, (0.5, 0.3, 0.2), workers=0), seed=3, dp_rank=0,
                                dp_size=1, micro_batch=8)
    sources = loader.sources
    lane = list(itertools.islice(lane_examples(sources, 1, 0, {k: start_position() for k in range(3)},
                                               [{}, {}, {}]), 300))
    schedule = sources.schedule.sources(np.arange(300) * 4 + 1)
    assert [k for k, *_ in lane] == schedule.tolist()
    for k in range(3):
        mine = [x for x in lane if x[0] == k]
        alone = list(itertools.islice(examples(sources.specs[k], 1, start_position(), {}), len(mine)))
        assert len(mine) > 30 and all(np.array_equal(a[0], b[1]) for a, b in zip(alone, mine))


def test_a_small_source_repeats_with_its_epochs_counted(shards, small_source):
    cfg = mixture(shards, small_source, (0.5, 0.3, 0.2), workers=0)
    loader = build_train_loader(cfg, seed=3, dp_rank=0, dp_size=1, micro_batch=8)
    # lane by lane, the small source's text runs on epoch after epoch: each of its documents is read again and again
    docs = [d for i in range(4) for d in tar_documents(Path(small_source, f"shard-{i:06d}.tar"))]
    text: list[int] = []
    for lane in range(4):
        its = lane_examples(loader.sources, lane, 0, {k: start_position() for k in range(3)}, [{}, {}, {}])
        text += [t for k, inputs, targets, _ in itertools.islice(its, 600) if k == 2 for t in uncorrupt(inputs, targets)]
    seen = Counter(tuple(text[i : i + 8]) for i in range(len(text) - 8))
    assert len(text) > 5 * sum(len(d) + 1 for d in docs)
    assert all(seen[tuple(d[:8])] >= 3 for d in docs)
    # the loader counts the epochs on every metrics line; the large sources are still in their first
    list(itertools.islice(loader, 300))  # 2,400 examples
    metrics = loader.metrics(lambda values: values)
    assert metrics["epochs/c"] > 4 and metrics["epochs/a"] < 1 and metrics["epochs/b"] < 1
    spec = cfg.input_length + loader.sources.specs[0].target_length
    assert sum(metrics[f"tokens_seen/{n}"] for n in "abc") == 2400 * spec
    assert metrics["tokens_seen/c"] == Schedule.of(3, (0.5, 0.3, 0.2)).counts(0, 2400)[2] * spec


BAD_CONFIGS = [
    ("data.sources=[{name: a, train: x, weight: 0}, {name: b, train: y, weight: 1}]",
     "data.sources 'a': weight (0.0) must be > 0: its share of the examples (leave the source out to train "
     "without it)"),
    ("data.sources=[{name: a, train: x, weight: -0.3}, {name: b, train: y, weight: 1.3}]",
     "data.sources 'a': weight (-0.3) must be > 0"),
    ("data.sources=[{name: a, train: x, weight: 0.7}, {name: b, train: y, weight: 0.2}]",
     "data.sources weights sum to 0.9 (a 0.7, b 0.2), not 1: each weight is its source's share of the examples; to "
     "keep their ratio, set a 0.7778, b 0.2222"),
    ("data.sources=[{name: a, train: x, weight: 0.5}, {name: a, train: y, weight: 0.5}]",
     "data.sources names 'a' more than once: each source needs a name of its own"),
    ("data.sources=[{name: a/b, train: x, weight: 1}]",
     "data.sources: the name 'a/b' (train 'x') must be letters, digits, _ . or -"),
    ("data.sources=[{name: a, trian: x, weight: 1}]",
     "unknown config key 'data.sources[0].trian'; did you mean 'train'?"),
    ("data.sources=[{name: a, train: x, weight: lots}]", "bad value for config key 'data.sources[0].weight': 'lots' is "
                                                         "not a float"),
    ("data.sources=a", "bad value for config key 'data.sources': a list [{name, train, weight, valid}, ...], not the "
                       "str 'a'"),
    ("data.sources=[{name: a, train: x/{0..3}.tar, weight: 1}]",
     "is not valid YAML (while parsing a flow mapping); inside [...] and {...} quote values that hold"),
]


@pytest.mark.parametrize("override, line", BAD_CONFIGS)
def test_bad_mixtures_are_one_line(override, line, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(Config, ["--config", TINY, override], prog="pretrain.train")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err, err


def test_bad_sources_of_shards_are_one_line(shards, small_source, tmp_path):
    both = "data.train=x", "data.sources=[{name: a, train: x, weight: 1}]"
    with pytest.raises(ConfigError, match=re.escape("data.train and data.sources are both set: data.train is the "
                                                    "one-source form of data.sources; set one of them")):
        load_config(Config, TINY, both)
    cases = [
        (mixture(shards, str(tmp_path / "none-*.tar"), (0.5, 0.3, 0.2)),
         f"data.sources 'c': no shards match '{tmp_path}/none-*.tar'; prepare them with `python -m "
         "pretrain.data.prepare`"),
    ]
    for cfg, line in cases:
        with pytest.raises(UsageError) as e:
            build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=2)
        assert str(e.value) == line
    with pytest.raises(UsageError, match=re.escape("the DP size (8) must divide data.streams (4; 0 means 64)")):
        build_train_loader(mixture(shards), seed=0, dp_rank=0, dp_size=8, micro_batch=2)


def test_resume_with_another_mixture_is_refused_unless_reweighted(shards, small_source, caplog):
    _, state = global_examples(mixture(shards, workers=0), [(2, 4, 5)])
    saved = {name: {s: p for r in state["ranks"] for s, p in r["positions"][name].items()} for name in "ab"}
    changes = [
        (mixture(shards, weights=(0.6, 0.4)), "a's weight (0.7 in the checkpoint, 0.6 now); b's weight (0.3 in the "
                                             "checkpoint, 0.4 now)"),
        (mixture(shards, small_source, (0.5, 0.3, 0.2)), "c is new; a's weight (0.7 in the checkpoint, 0.5 now)"),
    ]
    for cfg, named in changes:
        loader = build_train_loader(cfg, seed=3, dp_rank=0, dp_size=1, micro_batch=4)
        with pytest.raises(UsageError) as e:
            loader.load_state_dict(state)
        assert str(e.value) == (f"the data mixture changed since the checkpoint: {named}; the saved positions belong "
                                "to its mixture: restore data.sources, set data.reweight=true to go on with this one "
                                "(the sources whose shards are unchanged keep their positions), or start a new run.dir")
    # asked for: unchanged sources keep their positions (and counts), the changed one starts afresh, the change is
    # logged, and the new mixture's order goes on from the next example
    moved = mixture(shards, weights=(0.6, 0.4), reweight=True)
    moved = dataclasses.replace(moved, sources=[moved.sources[0], dataclasses.replace(
        moved.sources[1], train=f"{shards.train}/shard-{{000003..000006}}.tar")])
    loader = build_train_loader(moved, seed=3, dp_rank=0, dp_size=1, micro_batch=4)
    with caplog.at_level(logging.WARNING):
        loader.load_state_dict(state)
    assert "data.reweight: the mixture changed since the checkpoint (b's shards (4 shards in the checkpoint, 4 now; " \
           "not listed now: shard-000007.tar; new: shard-000003.tar); a's weight (0.7 in the checkpoint, 0.6 now); " \
           "b's weight (0.3 in the checkpoint, 0.4 now)); a keep their positions, b start afresh" in caplog.text
    assert {str(s): p for s, p in loader.positions[0].items()} == saved["a"]
    assert all(p == start_position() for p in loader.positions[1].values())
    assert loader.source_counts()[0] == state["ranks"][0]["counts"]["a"] and loader.consumed == 40
    next(iter(loader))
    assert json.loads(json.dumps(loader.state_dict()))["sources"][1]["weight"] == 0.4


def test_requeues_on_dp_2_1_4_through_the_trainer_equal_the_uninterrupted_run(shards, tmp_path):
    # the uninterrupted run at DP 2 (micro 4) saves step 4; from it, DP 1 (micro 2 x accumulation 4) runs 2 steps and
    # is requeued on 4 ranks (micro 1 x accumulation 2) to the end: the same examples in the same global batches, so
    # (dropout 0) the same losses up to summation order; every metrics line counts each source's tokens and epochs
    from tests.distributed import run_distributed
    from tests.test_train import COMMON, STEPS, _train_each, losses

    halves = [f"{shards.train}/shard-{{{a}..{b}}}.tar" for a, b in (("000000", "000003"), ("000004", "000007"))]
    sources = (f"data.sources=[{{name: a, train: '{halves[0]}', weight: 0.7, valid: '{shards.valid}'}}, "
               f"{{name: b, train: '{halves[1]}', weight: 0.3}}]")
    base = [*COMMON, sources, f"data.tokenizer={shards.tokenizer}", "data.workers=0", "zero.stage=1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_distributed(_train_each, 2, [(str(whole), base, None)]) == [[0]] * 2
    again = [*base, f"checkpoint.resume={whole}/checkpoints/step_4"]
    assert run_distributed(_train_each, 1, [(str(resumed), [*again, "train.micro_batch=2", "train.exit_after=2"],
                                             None)]) == [[0]]
    assert run_distributed(_train_each, 4, [(str(resumed), [*again, "train.micro_batch=1"], None)]) == [[0]] * 4
    reference, records = read_metrics(whole), read_metrics(resumed)
    assert [r["step"] for r in records] == list(range(5, STEPS + 1))
    np.testing.assert_allclose(losses(resumed), losses(whole)[4:], rtol=1e-5, atol=0)
    for r in reference + records:
        assert r["tokens_seen/a"] + r["tokens_seen/b"] == r["tokens_seen"]
        assert 0 <= r["epochs/a"] < 1 and 0 <= r["epochs/b"] < 1
    assert [(r["tokens_seen/a"], r["epochs/b"]) for r in records] == [(r["tokens_seen/a"], r["epochs/b"])
                                                                       for r in reference[4:]]
    # a's validation slice: eval_loss/a, and (b has none, data.valid is unset) no mixed eval_loss
    evals = [r for r in reference if "eval_loss/a" in r]
    assert [r["step"] for r in evals] == [4, 8] and not any("eval_loss" in r for r in reference)
    np.testing.assert_allclose(records[-1]["eval_loss/a"], evals[-1]["eval_loss/a"], rtol=1e-5)
    scalars = read_tensorboard(whole)
    assert [v for _, v in scalars["tokens_seen/b"]] == [r["tokens_seen/b"] for r in reference]


def test_reweight_moves_a_run_from_data_train_to_a_mixture(shards, small_source):
    # a curriculum: C4 alone (data.train), then C4 with your own text (4 shards: 4 streams from the start); `train`
    # keeps its positions
    _, state = global_examples(shards.config(workers=0, streams=4), [(2, 4, 3)])
    grown = shards.config(train="", streams=4, sources=[SourceConfig("train", shards.train, 0.8),
                                                        SourceConfig("c", small_source, 0.2)])
    with pytest.raises(UsageError, match=re.escape("the data mixture changed since the checkpoint: c is new; train's "
                                                   "weight (1 in the checkpoint, 0.8 now)")):
        build_train_loader(grown, seed=3, dp_rank=0, dp_size=1, micro_batch=4).load_state_dict(state)
    loader = build_train_loader(dataclasses.replace(grown, reweight=True), seed=3, dp_rank=0, dp_size=1,
                                micro_batch=4)
    loader.load_state_dict(state)
    saved = {int(s): p for r in state["ranks"] for s, p in r["positions"]["train"].items()}
    assert loader.positions[0] == {s: saved[s] for s in loader.lanes} and loader.consumed == 24
    assert loader.source_counts().tolist() == [24, 0]


def test_the_planner_reads_the_mixture(capsys):
    from pretrain.plan import main as plan

    mix = "data.sources=[{name: c4, train: x, weight: 0.7}, {name: mine, train: y, weight: 0.3}]"
    assert plan(["--config", TINY, "--nodes", "1", "--gpus-per-node", "2", mix]) == 0
    assert ("data: 2 sources in one order: c4 0.7, mine 0.3; 64 lanes (data.streams 0: the default): the run may use "
            "and move between DP sizes 1, 2, 4, 8, 16, 32, 64\n") in capsys.readouterr().out
    assert plan(["--config", TINY, "--nodes", "3", "--gpus-per-node", "2", mix, "data.streams=12", "train.global_batch=24"]) == 0
    assert ("12 lanes (data.streams 12): the run may use and move between DP sizes 1, 2, 3, 4, 6, 12\n"
            in capsys.readouterr().out)
    assert plan(["--config", TINY, "--nodes", "5", "--gpus-per-node", "1", mix, "train.global_batch=20"]) == 0
    assert ("DP sizes 1, 2, 4, 8, 16, 32, 64; DP 5 is not one of them: set data.streams to a multiple of it at the "
            "run's start (320 keeps the sizes above)\n") in capsys.readouterr().out
    assert plan(["--config", TINY, "--nodes", "1", "--gpus-per-node", "2", mix.replace("0.3", "0.2")]) == 2
    assert capsys.readouterr().err.startswith("pretrain.plan: data.sources weights sum to 0.9 (c4 0.7, mine 0.2)")


def test_a_data_state_of_an_older_order_is_one_line(shards):
    # version 3 (streams over whole shards, each epoch's tail dropped) and 2 (before mixtures) cannot continue exactly
    cfg = shards.config(workers=0)
    _, state = global_examples(cfg, [(2, 4, 2)])
    for version in (2, 3):
        old = {"ranks": [{**r, "version": version} for r in state["ranks"]]}
        with pytest.raises(UsageError, match=re.escape(f"the data position in the checkpoint is of data order version "
                                                       f"{version}, this code's is 4")):
            global_examples(cfg, [(1, 8, 1)], state=old)
