"""Any corpus on any number of ranks: a corpus in one file (prepared into one shard, or cut by size into several), and
a mixture with a source of one small shard, serve every DP size of the run's lanes with one global order, through the
loader and through the trainer, resumed on another DP size."""
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pretrain.core.config import SourceConfig
from pretrain.data.loader import build_train_loader
from pretrain.data.prepare import prepare
from pretrain.data.stream import cut_units
from tests.test_loader import _write_shard, global_examples, uncorrupt


@pytest.fixture(scope="module")
def one_file(shards, c4_dir, tmp_path_factory) -> dict[str, str]:
    """The fixture's eight train files as one json.gz, prepared at the default shard size (one shard) and cut into
    shards of 200k tokens (packs of 50k: six shards)."""
    folder = tmp_path_factory.mktemp("one-file")
    with gzip.open(folder / "c4-train.00000-of-00001.json.gz", "wb") as out:
        for f in sorted(c4_dir.glob("c4-train.*.json.gz")):
            out.write(gzip.decompress(f.read_bytes()))
    files = [str(folder / "c4-train.00000-of-00001.json.gz")]
    prepare(files, folder / "one", shards.tokenizer, workers=1)
    prepare(files, folder / "cut", shards.tokenizer, workers=1, pack_tokens=50_000, shard_tokens=200_000)
    return {"one": str(folder / "one"), "cut": str(folder / "cut")}


def test_prepare_cuts_a_large_file_into_shards_of_the_size_asked(one_file):
    one = json.loads(Path(one_file["one"], "index.json").read_text())
    cut = json.loads(Path(one_file["cut"], "index.json").read_text())
    assert list(one["shards"]) == ["shard-000000.tar"]
    names = ["shard-000000.tar"] + [f"shard-000000-{i:04d}.tar" for i in range(1, 6)]
    assert sorted(cut["shards"]) == sorted(names)
    # every shard but the last holds the size asked, to the pack that crossed it; nothing lost or added
    sizes = [cut["shards"][n]["tokens"] for n in names]
    assert all(200_000 <= s < 250_000 for s in sizes[:-1]) and 0 < sizes[-1] < 250_000
    assert (cut["documents"], cut["tokens"]) == (one["documents"], one["tokens"]) == (sum(
        e["documents"] for e in cut["shards"].values()), sum(sizes))
    assert cut["inputs"]["shard-000000.tar"]["parts"] == {n: {k: e[k] for k in ("documents", "tokens", "packs")}
                                                          for n, e in cut["shards"].items()}


def test_units_cover_every_document_once(one_file):
    docs = (247, 5, 0)
    units = cut_units(3, docs, 8)
    assert len(units) == 9 and all(u[2] == -1 for u in units[2::3])
    for shard, n in enumerate(docs):  # each shard's slices tile its documents
        mine = [u for u in units if u[0] == shard]
        assert [u[1] for u in mine] == [0, n // 3, 2 * n // 3] and [u[2] for u in mine[:-1]] == [n // 3, 2 * n // 3]
    assert cut_units(9, None, 8) == tuple((i, 0, -1) for i in range(9))
    assert cut_units(2, None, 8) == tuple((i, 0, -1) for i in range(2) for _ in range(4))  # no index: replicas


def test_a_one_file_corpus_gives_the_same_global_batches_on_dp_1_2_4_8(shards, one_file):
    cfg = lambda workers: shards.config(train=one_file["one"], streams=0, workers=workers)  # noqa: E731  (64 lanes)
    reference, _ = global_examples(cfg(0), [(1, 16, 12)], global_batch=16)
    assert len(set(reference)) == len(reference) == 192
    for workers, (dp, micro) in [(2, (2, 8)), (0, (4, 2)), (1, (8, 1))]:
        got, _ = global_examples(cfg(workers), [(dp, micro, 12)], global_batch=16)
        assert got == reference, (workers, dp, micro)
    # a requeue from DP 4 to DP 2, then to DP 8, continues with the next example
    first, state = global_examples(cfg(0), [(4, 2, 5)], global_batch=16)
    second, state = global_examples(cfg(0), [(2, 4, 3)], global_batch=16, state=state)
    third, _ = global_examples(cfg(0), [(8, 1, 4)], global_batch=16, state=state)
    assert first + second + third == reference


def test_each_lane_reads_its_own_slice_of_a_one_shard_corpus(shards, one_file):
    # the first example of each of the 64 lanes starts where its unit starts: 64 different places in the one file
    loader = build_train_loader(shards.config(train=one_file["one"], streams=0, workers=0, shuffle_buffer=1), seed=5,
                                dp_rank=0, dp_size=1, micro_batch=64)
    batch = next(iter(loader))
    texts = [tuple(uncorrupt(i, t)[:20]) for i, t in zip(batch["input_ids"].tolist(), batch["labels"].tolist())]
    assert len(set(texts)) == 64


def test_a_one_shard_source_of_a_mixture_runs_at_dp_2_and_keeps_its_share(shards, tmp_path):
    # 100 short sentences in one shard, their ids apart from everything else (900-999), beside C4 at 0.9 / 0.1
    _write_shard(tmp_path / "shard-000000.tar", [[900 + (i * 7 + j) % 100 for j in range(12 + i % 9)]
                                                 for i in range(100)])
    sources = [SourceConfig("c4", shards.train, 0.9), SourceConfig("tiny", str(tmp_path), 0.1)]
    cfg = shards.config(train="", sources=sources, streams=0, workers=1)
    rows, _ = global_examples(cfg, [(2, 8, 50)], global_batch=16)  # 800 examples
    reference, _ = global_examples(cfg, [(1, 16, 50)], global_batch=16)
    assert rows == reference
    tiny = [set(uncorrupt(i, t)) <= set(range(900, 1000)) | {1} for i, t in rows]  # its ids and EOS only
    assert abs(sum(tiny) - 80) <= 4  # 10% of 800, as the schedule deals them


def test_a_one_file_corpus_trains_on_4_ranks_and_a_requeue_on_2_equals_the_straight_run(shards, one_file, tmp_path):
    from tests.distributed import run_distributed
    from tests.test_train import COMMON, _train_each, losses

    base = [*COMMON, f"data.train={one_file['one']}", f"data.valid={shards.valid}", f"data.tokenizer={shards.tokenizer}",
            "data.workers=0", "zero.stage=1", "train.micro_batch=2", "eval.every=0"]
    straight, requeued = tmp_path / "straight", tmp_path / "requeued"
    assert run_distributed(_train_each, 4, [(str(straight), base, None)]) == [[0]] * 4
    shutil.copytree(straight / "checkpoints" / "step_4", tmp_path / "step_4")
    again = [*base, f"checkpoint.resume={tmp_path}/step_4", "train.micro_batch=4"]
    assert run_distributed(_train_each, 2, [(str(requeued), again, None)]) == [[0]] * 2
    np.testing.assert_allclose(losses(requeued), losses(straight)[4:], rtol=1e-5, atol=0)
