"""Streaming loader: epoch coverage across streams, one global order at any DP size / micro batch / workers,
exact resume on any layout, damaged shards, shard specs (directory, glob, braces, pipe:, HTTP on loopback), the
fixed validation slice."""
import functools
import http.server
import itertools
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tarfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from webdataset import TarWriter

from pretrain.core.config import UsageError
from pretrain.data.documents import expand_glob
from pretrain.data.loader import _SETTING_KEYS, build_eval_loader, build_train_loader
from pretrain.data.prepare import prepare
from pretrain.data.shards import encode_pack
from pretrain.data.stream import examples, start_position

SENTINEL_FLOOR = 1000  # ids >= this are sentinels of the 1100-id test tokenizer


def uncorrupt(inputs, targets) -> list[int]:
    """The raw chunk back from (inputs, targets): each sentinel in the inputs replaced by its target span."""
    inputs, targets = [int(t) for t in inputs if t not in (-100,)], [int(t) for t in targets if t != -100]
    spans, current = {}, None
    for t in targets[:-1]:
        if t >= SENTINEL_FLOOR:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    out = []
    for t in inputs[:-1]:
        out.extend(spans[t] if t >= SENTINEL_FLOOR else [t])
    return out


def tar_documents(path) -> list[tuple[int, ...]]:
    """Token ids per document, read with the standard tarfile module (independent of the loader): each pack's
    `.u16` member cut at the document lengths of its `.lengths.u32` member."""
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    docs = []
    for name in sorted(n for n in members if n.endswith(".u16")):
        tokens = np.frombuffer(members[name], "<u2").tolist()
        ends = np.cumsum(np.frombuffer(members[name[: -len("u16")] + "lengths.u32"], "<u4")).tolist()
        docs += [tuple(tokens[a:b]) for a, b in zip([0] + ends[:-1], ends)]
    return docs


def assert_same_batches(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_every_document_once_per_epoch_disjoint_across_streams(shards):
    # a shuffle buffer of one chunk keeps each stream in reading order, so its documents can be cut back out
    cfg = shards.config(workers=2, shuffle_buffer=1, streams=4)
    reference = [doc + (1,) for p in sorted(Path(shards.train).glob("*.tar"))
                 for doc in tar_documents(p)]
    spec = build_train_loader(cfg, seed=5, dp_rank=0, dp_size=1, micro_batch=4).sources.specs[0]
    seen_by_stream = []
    for stream in range(4):
        tokens = []
        for inputs, targets, after in examples(spec, stream, start_position(), {}):
            if after["epoch"] == 1:
                break
            tokens += uncorrupt(inputs, targets)
        cut = np.flatnonzero(np.array(tokens) == 1)
        whole = np.split(np.array(tokens), cut + 1)
        seen_by_stream.append([tuple(d.tolist()) for d in whole[:-1]])  # the tail is a partial document: dropped
        assert len(whole[-1]) < spec.raw_length + max(map(len, reference))
    counts = Counter(reference)  # a few short documents (e.g. repeated sections) occur more than once
    unique = {d for d, n in counts.items() if n == 1}
    for a, b in itertools.combinations(seen_by_stream, 2):
        assert not (set(a) & set(b)) & unique  # disjoint across streams
    seen = Counter(d for docs in seen_by_stream for d in docs)
    assert not seen - counts  # nothing twice, nothing invented
    assert sum((counts - seen).values()) <= 4  # at most the cut-off last document of each of the 4 streams


def test_identical_across_tp_peers_and_deterministic(shards):
    cfg = shards.config(workers=2)
    runs = []
    for global_seed in (0, 1):  # TP peers share the DP rank; process-global randomness must not matter
        torch.manual_seed(global_seed)
        np.random.seed(global_seed)
        loader = build_train_loader(cfg, seed=3, dp_rank=1, dp_size=2, micro_batch=4)
        runs.append(list(itertools.islice(loader, 6)))
    assert_same_batches(runs[0], runs[1])
    other_seed = list(itertools.islice(build_train_loader(cfg, seed=4, dp_rank=1, dp_size=2, micro_batch=4), 1))
    assert not torch.equal(other_seed[0]["input_ids"], runs[0][0]["input_ids"])
    other_rank = list(itertools.islice(build_train_loader(cfg, seed=3, dp_rank=0, dp_size=2, micro_batch=4), 1))
    assert not torch.equal(other_rank[0]["input_ids"], runs[0][0]["input_ids"])


def global_examples(cfg, layout: list[tuple[int, int, int]], seed: int = 3, global_batch: int = 8,
                    state: dict | None = None) -> tuple[list[tuple], dict]:
    """Rows (input ids, labels) of consecutive global batches, computed as `layout` says: a list of (DP size,
    micro batch, global batches), each part resumed from the last's states; every DP rank's examples put back at
    their global index (example j of DP rank r is global example j * D + r). Also the final state."""
    out = []
    for dp, micro, num_batches in layout:
        per_rank, states = [], []
        for rank in range(dp):
            loader = build_train_loader(cfg, seed=seed, dp_rank=rank, dp_size=dp, micro_batch=micro)
            if state is not None:
                loader.load_state_dict(state)
            got = list(itertools.islice(loader, num_batches * global_batch // (dp * micro)))
            per_rank.append([(tuple(i.tolist()), tuple(t.tolist())) for b in got
                             for i, t in zip(b["input_ids"], b["labels"])])
            states.append(json.loads(json.dumps(loader.state_dict())))  # plain data
        out += [per_rank[i % dp][i // dp] for i in range(num_batches * global_batch)]
        state = {"ranks": states}
    return out, state


def test_global_batches_are_the_same_at_any_dp_size_micro_batch_and_workers(shards):
    reference, _ = global_examples(shards.config(workers=0), [(1, 8, 6)])
    assert len(set(reference)) == len(reference) == 48
    for workers, (dp, micro) in [(2, (1, 4)), (1, (2, 4)), (2, (2, 1)), (3, (4, 2)), (2, (8, 1))]:
        got, _ = global_examples(shards.config(workers=workers), [(dp, micro, 6)])
        assert got == reference, (workers, dp, micro)


def test_resume_on_any_layout_continues_with_the_next_example(shards):
    # DP 2 -> DP 1 (workers 1 -> 3) -> DP 4, with other micro batches: the uninterrupted run's examples, in order
    reference, _ = global_examples(shards.config(workers=1), [(2, 4, 12)])
    first, state = global_examples(shards.config(workers=1), [(2, 4, 3)])
    second, state = global_examples(shards.config(workers=3), [(1, 2, 4)], state=state)
    third, state = global_examples(shards.config(workers=2), [(4, 1, 5)], state=state)
    assert first + second + third == reference
    assert {r["examples"] for r in state["ranks"]} == {96}


def test_a_killed_worker_is_named(shards):
    # the OOM killer's way: SIGKILL while items are queued; iterating in another thread keeps torch's SIGCHLD
    # handler (main thread only) out. The items queued by the dead worker (numpy rows, no shared-memory handles)
    # are still read; then the error names the worker, whether it comes from torch's own check or from a closed
    # connection (test below). One stream keeps the queued items small enough for the pipe: a worker killed in
    # the middle of writing an item would leave half a message that only that SIGCHLD handler interrupts
    loader = build_train_loader(shards.config(workers=1, streams=1), seed=3, dp_rank=0, dp_size=1, micro_batch=2)
    it = iter(loader)
    errors = []

    def consume():
        next(it)
        time.sleep(1)  # the worker fills its prefetch queue
        worker = loader._iterator._workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        try:
            for _ in range(100):  # past the items already queued (4 per worker, ROWS examples each)
                next(it)
        except Exception as error:
            errors.append((worker.pid, error))

    thread = threading.Thread(target=consume)
    thread.start()
    thread.join()
    (pid, error), = errors
    assert isinstance(error, RuntimeError), repr(error)
    assert re.search(rf"DataLoader worker \(pid(\(s\))? {pid}\b.*\) exited unexpectedly", str(error)), error
    assert loader._iterator is None  # closed on the way out


def _close_files_then_sleep() -> None:
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # its sockets and its sentinel pipe
    time.sleep(60)


def test_a_worker_killed_a_moment_before_its_socket_closes_is_named(shards):
    # the race torch's own check loses (seen on CI): the dead worker's socket is closed but the process cannot be
    # reaped yet, so torch re-raises the bare ConnectionResetError; the loader waits for the worker to end. A dying
    # process closes its files (sentinel pipe included) before it can be reaped, for as long as a loaded machine
    # takes (seen in a session that also built the fixtures): here the worker closes them itself, then dies
    worker = multiprocessing.get_context("fork").Process(target=_close_files_then_sleep)
    worker.start()

    class QueuedBatchOfTheDeadWorker:
        _workers = [worker]

        def __next__(self):
            threading.Timer(0.2, os.kill, (worker.pid, signal.SIGKILL)).start()  # it dies a moment later
            raise ConnectionResetError(104, "Connection reset by peer")

    loader = build_train_loader(shards.config(workers=1), seed=3, dp_rank=0, dp_size=1, micro_batch=2)
    loader._iterator = QueuedBatchOfTheDeadWorker()
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {worker.pid}, killed by SIGKILL\) exited"):
        loader._next_item()


def test_batch_format(shards):
    batch = next(iter(build_train_loader(shards.config(), seed=0, dp_rank=0, dp_size=1, micro_batch=3)))
    # span-corrupted chunks fill inputs and targets exactly: no padding, so no masks (the model reads a missing
    # mask as "nothing padded" without looking at the device)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (3, 64), "decoder_input_ids": (3, 14), "labels": (3, 14)}
    assert all(v.dtype == torch.int64 for v in batch.values())
    labels = batch["labels"]
    assert (batch["input_ids"] != 0).all() and (labels != -100).all()
    assert torch.equal(batch["decoder_input_ids"][:, 0], torch.zeros(3, dtype=torch.int64))
    assert torch.equal(batch["decoder_input_ids"][:, 1:], labels[:, :-1].clamp(min=0))
    assert (labels[:, 0] == 1099).all()  # targets start with <extra_id_0>
    for inputs, targets in zip(batch["input_ids"], labels):
        assert len(uncorrupt(inputs, targets)) == 70


@pytest.fixture(scope="module")
def small_packs(shards, c4_dir, tmp_path_factory) -> str:
    """The fixture's train shards prepared again with packs of ~2,048 tokens (~70 per shard instead of one)."""
    out = tmp_path_factory.mktemp("small-packs")
    prepare(expand_glob(str(c4_dir / "c4-train.*.json.gz")), out, shards.tokenizer, workers=2, pack_tokens=2048)
    return str(out)


def test_pack_size_does_not_change_the_batches(shards, small_packs):
    def first(spec):
        cfg = shards.config(train=spec, workers=2, shuffle_buffer=200)
        return list(itertools.islice(build_train_loader(cfg, seed=2, dp_rank=1, dp_size=2, micro_batch=64), 12))

    assert_same_batches(first(small_packs), first(shards.train))


@pytest.mark.parametrize("stop, packed", [(3, False), (57, True)])
def test_resume_is_exact_with_workers_and_across_epochs(shards, small_packs, stop, packed):
    # 8 streams of one shard (~2k chunks each): 256-example batches cross into epoch 1 after ~65 batches;
    # with small packs the resume point lies past the first packs of a shard, which are skipped undecoded
    cfg = shards.config(train=small_packs if packed else shards.train, workers=2, shuffle_buffer=200)
    make = functools.partial(build_train_loader, cfg, seed=11, dp_rank=0, dp_size=1, micro_batch=256)
    whole = make()
    full = list(itertools.islice(whole, 80))
    assert max(p["epoch"] for p in whole.state_dict()["positions"]["train"].values()) == 1
    first = make()
    list(itertools.islice(first, stop))
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    resumed = make()
    resumed.load_state_dict({"ranks": [state]})
    assert_same_batches(list(itertools.islice(resumed, 80 - stop)), full[stop:])


# Every data setting the loader saves: the change tried on resume, and what the refusal names; None: the change
# is allowed (the data order is global: micro batch and DP size only decide who computes which example). The
# refused rows must be the loader's own list, so a setting it starts saving is tried here too.
SETTING_CHANGES = {
    "seed": ({"seed": 2}, "run.seed (1 in the checkpoint, 2 now)"),
    "streams": ({"streams": 4}, "data.streams (8 in the checkpoint, 4 now)"),
    "shuffle_buffer": ({"shuffle_buffer": 32}, "data.shuffle_buffer (64 in the checkpoint, 32 now)"),
    "input_length": ({"input_length": 48}, "data.input_length (64 in the checkpoint, 48 now)"),
    "noise_density": ({"noise_density": 0.2}, "data.noise_density (0.15 in the checkpoint, 0.2 now)"),
    "mean_noise_span_length": ({"mean_noise_span_length": 2.0},
                               "data.mean_noise_span_length (3.0 in the checkpoint, 2.0 now)"),
    "micro_batch": ({"micro_batch": 2}, None),
}


def test_every_saved_data_setting_is_tried_on_resume():
    assert {k for k, (_, named) in SETTING_CHANGES.items() if named} == _SETTING_KEYS.keys()


@pytest.mark.parametrize("setting", SETTING_CHANGES)
def test_resume_with_other_data_settings_is_refused(shards, setting):
    # the saved settings are checked before any position is used: a fresh loader's state is enough
    change, named = SETTING_CHANGES[setting]
    change = dict(change)
    args = {"seed": change.pop("seed", 1), "micro_batch": change.pop("micro_batch", 4)}  # not data settings
    state = {"ranks": [build_train_loader(shards.config(workers=1), seed=1, dp_rank=0, dp_size=1,
                                          micro_batch=4).state_dict()]}
    changed = build_train_loader(shards.config(workers=1, **change), dp_rank=0, dp_size=1, **args)
    if named is None:
        changed.load_state_dict(state)
        return
    with pytest.raises(UsageError, match=re.escape(named)):
        changed.load_state_dict(state)


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_shard(shards, tmp_path):
    for shard in Path(shards.train).iterdir():
        shutil.copy(shard, tmp_path / shard.name)
    bad = tmp_path / "shard-000003.tar"
    with open(bad, "wb") as f, TarWriter(f, encoder=False, mtime=0) as writer:
        writer.write(encode_pack("bad_000000", [[5, 6, 1100 + 7]], [""], "u16"))  # 1100 ids: 1107 is beyond
    cfg = shards.config(train=str(tmp_path), workers=0)
    with pytest.raises(UsageError, match=r"shard .*shard-000003.tar holds token id 1107, beyond the 1100 ids"):
        list(itertools.islice(build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=4), 10_000))


def _write_shard(path: Path, docs: list[list[int]]) -> None:
    """A format-2 shard of `docs` in one pack, as another tool or an older prepare may have written it."""
    with open(path, "wb") as f, TarWriter(f, encoder=False, mtime=0) as writer:
        writer.write(encode_pack(f"{path.stem}_000000", docs, [""] * len(docs), "u16"))


def test_a_stream_of_empty_documents_is_refused_naming_the_shards(shards, tmp_path, caplog):
    for name in ("shard-000000.tar", "shard-000001.tar"):
        _write_shard(tmp_path / name, [[]] * 500)  # an EOS-only stream: the loss falls while nothing is learnt
    loader = build_train_loader(shards.config(train=str(tmp_path), workers=0, streams=1), seed=0, dp_rank=0,
                                dp_size=1, micro_batch=4)
    with caplog.at_level(logging.WARNING), pytest.raises(UsageError) as e:
        next(iter(loader))
    assert str(e.value) == (f"no readable data in any of the 2 shards ({tmp_path}/shard-000000.tar, "
                            f"{tmp_path}/shard-000001.tar): damaged, empty or only empty documents; check data.train")
    assert caplog.text.count("skipped 500 empty documents (no tokens) of shard") == 2


def test_a_few_empty_documents_are_skipped_and_counted(shards, tmp_path, caplog):
    eos = 1
    docs = [[] if i % 10 == 3 else [2 + i % 7] * (5 + i % 11) for i in range(300)]  # 30 empty
    _write_shard(tmp_path / "shard-000000.tar", docs)
    cfg = shards.config(train=str(tmp_path), workers=0, shuffle_buffer=4)
    make = functools.partial(build_train_loader, cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=2)
    with caplog.at_level(logging.WARNING):
        stream = [uncorrupt(i, t) for i, t, _ in examples(make().sources.specs[0], 0, start_position(), {}, cycle=False)]
    assert "skipped 30 empty documents (no tokens) of shard" in caplog.text
    assert stream and not any(a == b == eos for chunk in stream for a, b in zip(chunk, chunk[1:]))  # no EOS, EOS
    assert sum(chunk.count(eos) for chunk in stream) <= 270  # at most one EOS per non-empty document
    # a resume point among the empty documents still continues exactly
    whole = list(itertools.islice(make(), 12))
    for stop in range(1, 11):
        first = make()
        list(itertools.islice(first, stop))
        resumed = make()
        resumed.load_state_dict({"ranks": [first.state_dict()]})
        assert_same_batches(list(itertools.islice(resumed, 12 - stop)), whole[stop:])


@pytest.mark.parametrize("shuffle_buffer", [20, 2000])  # many blocks a pack, and a block of more than a pack
def test_a_live_stream_holds_its_corrupted_block_and_one_pack(shards, tmp_path, shuffle_buffer):
    # between blocks a stream holds its corrupted block and at most one pack's text: not the joined text, the
    # block's raw chunks, nor a pack left in a suspended reader's frame (webdataset's group_by_keys, enumerate's
    # last item), each of which once held a pack more; a rank's host memory is its live streams times this
    rng = np.random.default_rng(0)
    docs_per_pack, doc_tokens = 200, 500
    with open(tmp_path / "shard-000000.tar", "wb") as f, TarWriter(f, encoder=False, mtime=0) as writer:
        for p in range(12):
            docs = rng.integers(3, 1000, size=(docs_per_pack, doc_tokens)).tolist()
            writer.write(encode_pack(f"shard-000000_{p:06d}", docs, [""] * len(docs), "u16"))
    cfg = shards.config(train=str(tmp_path), workers=0, streams=1, shuffle_buffer=shuffle_buffer)
    spec = build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=1).sources.specs[0]
    stream = examples(spec, 0, start_position(), {})
    tracemalloc.start()
    try:
        for _ in range(3 * spec.block_chunks + 1):  # into the fourth block
            next(stream)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    block = spec.block_chunks * (spec.input_length + spec.target_length) * 2  # inputs and targets, uint16
    pack = docs_per_pack * (doc_tokens + 1) * 2  # with EOS
    assert held < 1.1 * (block + pack) + 64 * 1024, (held, block, pack)


def test_streams_and_dp_size_that_do_not_fit_are_clear_errors(shards):
    with pytest.raises(UsageError, match=re.escape("the DP size (3) must divide data.streams (8; 0 means 64): each DP "
                                                   "rank owns whole streams; set data.streams at the run's start to a "
                                                   "multiple of every DP size it may use (e.g. 24)")):
        build_train_loader(shards.config(), seed=0, dp_rank=0, dp_size=3, micro_batch=2)
    with pytest.raises(ValueError, match="no shards match"):
        build_train_loader(shards.config(train=shards.train + "/none-*.tar"), seed=0, dp_rank=0, dp_size=1,
                           micro_batch=2)


def test_damaged_shards_are_skipped_with_a_warning(shards, small_packs, tmp_path, caplog):
    names = ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    for n in names + ["index.json"]:  # the index's document counts reveal a silently short shard
        shutil.copy(f"{small_packs}/{n}", tmp_path / n)  # ~70 packs each: damage can hit a member header
    data = (tmp_path / names[0]).read_bytes()
    (tmp_path / names[0]).write_bytes(data[: len(data) // 3])  # truncated tar
    data = bytearray((tmp_path / names[1]).read_bytes())
    data[len(data) // 2 : len(data) // 2 + 1024] = b"\x07" * 1024  # garbled mid-shard: a header and/or pack data
    (tmp_path / names[1]).write_bytes(bytes(data))
    with tarfile.open(tmp_path / names[2]) as tar:  # garbled ids inside a pack: only its crc32 reveals it
        member = [m for m in tar.getmembers() if m.name.endswith(".u16")][3]
    data = bytearray((tmp_path / names[2]).read_bytes())
    data[member.offset_data + 100 : member.offset_data + 104] = b"\x01\x02\x03\x04"
    (tmp_path / names[2]).write_bytes(bytes(data))
    # one stream reads all three; most of their documents are lost, a share allowed here
    cfg = shards.config(train=str(tmp_path / "*.tar"), shuffle_buffer=16, streams=1, max_damaged_share=1)
    loader = build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=256)
    with caplog.at_level(logging.WARNING):
        got = list(itertools.islice(loader, 40))  # well past one epoch of the three shards
    assert len(got) == 40
    assert sorted(loader.damaged[0].found) == [0, 1, 2]
    assert "damaged shards skipped: " in caplog.text  # logged by the main process
    damaged = {}  # one epoch in this process, where the per-shard warnings can be read
    with caplog.at_level(logging.WARNING):
        for _, _, after in examples(loader.sources.specs[0], 0, start_position(), damaged):
            if after["epoch"] == 1:
                break
    assert sorted(damaged) == [0, 1, 2] and damaged == loader.damaged[0].found  # documents read before the damage
    assert "fails its crc32 check" in caplog.text


def cut_shards(shards, folder: Path, which) -> Path:
    """A copy of the fixture's train shards and index in `folder`, the shards numbered `which` cut to a quarter of
    their bytes (the issue's case: with 8 streams, a cut shard is its stream's only shard in some epoch)."""
    shutil.copytree(shards.train, folder)
    for i in which:
        shard = folder / f"shard-{i:06d}.tar"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 4])
    return folder


def test_damaged_shards_leave_one_global_order_on_every_layout(shards, tmp_path):
    # every other shard cut: a stream whose epoch gives nothing goes on with its next epoch, a rule of the stream
    # alone, so whichever rank or worker finds the damage, and whenever, every layout gets the same global batches,
    # and a resume on another layout continues with the next example
    cfg = functools.partial(shards.config, train=str(cut_shards(shards, tmp_path / "cut", [1, 3, 5, 7])),
                            max_damaged_share=0.6)
    reference, state = global_examples(cfg(workers=0), [(1, 8, 12)])
    assert len(set(reference)) == len(reference) == 96
    assert sorted(int(i) for r in state["ranks"] for i in r["damaged"]["train"]) == [1, 3, 5, 7]
    # the four streams whose epoch-0 shard is cut went on with later epochs; 12 examples are far from the end of
    # any intact shard (~2,000 chunks)
    assert sum(p["epoch"] > 0 for r in state["ranks"] for p in r["positions"]["train"].values()) == 4
    for workers, (dp, micro) in [(2, (1, 4)), (1, (2, 4)), (3, (4, 2)), (2, (8, 1))]:
        got, _ = global_examples(cfg(workers=workers), [(dp, micro, 12)])
        assert got == reference, (workers, dp, micro)
    first, state = global_examples(cfg(workers=1), [(2, 4, 3)])
    second, state = global_examples(cfg(workers=3), [(1, 2, 4)], state=state)
    # the cut shards "heal" before the last requeue (a transient HTTP failure): the state's record of the damage
    # keeps them read only up to it, so the run goes on as it began
    for i in (1, 3, 5, 7):
        shutil.copy(Path(shards.train, f"shard-{i:06d}.tar"), tmp_path / "cut")
    third, state = global_examples(cfg(workers=2), [(4, 1, 5)], state=state)
    assert first + second + third == reference
    assert {r["examples"] for r in state["ranks"]} == {96}


def test_damage_beyond_max_damaged_share_is_refused_also_on_resume(shards, tmp_path):
    cut = str(cut_shards(shards, tmp_path / "cut", [1, 3, 5, 7]))
    documents = {name: entry["documents"] for name, entry in
                 json.loads(Path(shards.train, "index.json").read_text())["shards"].items()}
    share = lambda names: sum(documents[n] for n in names) / sum(documents.values())
    cuts = [f"shard-{i:06d}.tar" for i in (1, 3, 5, 7)]
    lost = share(cuts)
    # the first item of the loader's rows holds every stream's first rows, so all four cut shards (its streams'
    # epoch-0 shards), and 50% lost is more than 0.2, the default
    loader = build_train_loader(shards.config(train=cut, workers=0), seed=3, dp_rank=0, dp_size=1, micro_batch=8)
    with pytest.raises(UsageError) as e:
        next(iter(loader))
    named = ", ".join(f"{cut}/{n} (0 of {documents[n]} documents read)" for n in cuts[:3])
    assert str(e.value) == (f"damaged shards lost {lost:.1%} of data.train, more than data.max_damaged_share (0.2): "
                            f"{named} and 1 more; repair them or prepare them again, or raise data.max_damaged_share "
                            "to train on the rest")
    # a run that allowed it records the damage in its state; a resume that allows less refuses at once, on every
    # DP rank (each reads every saved rank's record), before reading any shard
    _, state = global_examples(shards.config(train=cut, workers=0, max_damaged_share=0.6), [(2, 4, 2)])
    stricter = build_train_loader(shards.config(train=cut, workers=0, max_damaged_share=0.4), seed=3, dp_rank=1,
                                  dp_size=4, micro_batch=2)
    with pytest.raises(UsageError, match=re.escape(f"damaged shards lost {lost:.1%} of data.train, more than "
                                                   "data.max_damaged_share (0.4)")):
        stricter.load_state_dict(state)


def test_a_failing_pipe_command_is_one_line_naming_it_and_its_status(shards, capsys):
    from pretrain.runtime.faults import EXIT_USAGE, run_with_exit_codes

    for command, status in [("false", "exited with status 1"),
                            ("no-such-command-here", "exited with status 127 (command not found)"),
                            (f"cat {shards.train}/shard-000000.tar; exit 3", "exited with status 3")]:
        # in a DataLoader worker, as the trainer reads: the worker's error reaches the job as its one line
        loader = build_train_loader(shards.config(train=f"pipe:{command}", workers=1, streams=1), seed=0,
                                    dp_rank=0, dp_size=1, micro_batch=2)
        assert run_with_exit_codes(lambda: list(itertools.islice(loader, 10_000)), "pretrain.train") == EXIT_USAGE
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain.train")]
        assert lines == [f"pretrain.train: error: the command of shard 'pipe:{command}' {status}; it must write the "
                         f"shard's tar to stdout: run `{command}` in a shell to see why, then fix data.train / "
                         "data.valid"]


def test_shards_of_another_format_are_refused(shards, tmp_path):
    shutil.copy(f"{shards.train}/shard-000000.tar", tmp_path)
    index = json.loads(Path(shards.train, "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps({**index, "format": 1}))
    with pytest.raises(ValueError, match="in format 1, this loader reads format 2; prepare them again"):
        build_train_loader(shards.config(train=str(tmp_path)), seed=0, dp_rank=0, dp_size=1, micro_batch=2)


@pytest.fixture
def http_shards(shards):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=shards.train)
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_shard_specs_stream_the_same_batches(shards, http_shards):
    def first(spec, workers=2):
        cfg = shards.config(train=spec, workers=workers)
        return list(itertools.islice(build_train_loader(cfg, seed=2, dp_rank=0, dp_size=2, micro_batch=4), 4))

    reference = first(shards.train)
    assert_same_batches(first(shards.train + "/shard-*.tar"), reference)
    assert_same_batches(first(shards.train + "/shard-{000000..000007}.tar"), reference)
    assert_same_batches(first(f"pipe:cat {shards.train}/shard-{{000000..000007}}.tar"), reference)
    assert_same_batches(first(http_shards + "/shard-{000000..000007}.tar"), reference)


def test_eval_slice_is_fixed_and_the_same_examples_on_every_layout(shards):
    cfg = shards.config()
    rows = lambda loader: [tuple(r.tolist()) for batch in loader for r in batch["input_ids"]]
    whole = rows(build_eval_loader(cfg, dp_rank=0, dp_size=1, micro_batch=4, num_examples=24))
    a = build_eval_loader(cfg, dp_rank=0, dp_size=2, micro_batch=4, num_examples=24)
    # rebuilt for another run: the slice does not depend on the loader workers of training
    again = build_eval_loader(shards.config(workers=3), dp_rank=0, dp_size=2, micro_batch=4, num_examples=24)
    b = build_eval_loader(cfg, dp_rank=1, dp_size=2, micro_batch=4, num_examples=24)
    assert len(a) == 3 and a.batches[0]["input_ids"].shape == (4, 64)
    assert a.batches is not again.batches
    assert_same_batches(list(a), list(again))
    assert rows(a) == whole[0::2] and rows(b) == whole[1::2]  # example i on DP rank i % DP
    quarters = [rows(build_eval_loader(cfg, dp_rank=r, dp_size=4, micro_batch=2, num_examples=24)) for r in range(4)]
    assert sorted(sum(quarters, [])) == sorted(whole)
    with pytest.raises(ValueError, match="too few"):
        build_eval_loader(cfg, dp_rank=0, dp_size=1, micro_batch=64, num_examples=64000)
