"""What the checksums in complete.json add to a checkpoint save: a real `CheckpointManager.save` of a DeepSpeed
engine (one process, gloo, fp32, ZeRO 1, Adam) on configs/tiny.yaml widened to a few hundred MB of checkpoint,
timed whole and in its checksum part (`pretrain.core.manifest.describe` over the files the save wrote, as the save
runs it), plus zlib's crc32 on a buffer in memory.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.checkpoint_checksum [--d-model 256] [--saves 3] [--dir DIR]

DIR (default: a temporary folder) should be on the filesystem the checkpoints go to.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from pretrain.core.config import Config, ParallelConfig, load_config
from pretrain.core.manifest import describe
from pretrain.distributed.parallel import destroy_distributed, init_distributed
from pretrain.model import build_model, universal_checkpoint_info
from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs
from pretrain.runtime.engine import build_engine


def _crc32_rate(size: int = 256 << 20, chunk: int = 16 << 20) -> float:
    """Bytes per second of zlib.crc32 over an in-memory buffer, in the pieces the manifest reads."""
    data = memoryview(os.urandom(size))
    start = time.perf_counter()
    crc = 0
    for i in range(0, size, chunk):
        crc = zlib.crc32(data[i : i + chunk], crc)
    return size / (time.perf_counter() - start)


def wide_engine(d: int):
    """One process (gloo), configs/tiny.yaml widened to `d` (d_ff 4d, 4 layers, 32128 ids), fp32 Adam ZeRO 1,
    after one step (Adam's moments exist: the optimizer shard has its full size): (cfg, dims, model, engine,
    step), `step()` one more training step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = load_config(Config, "configs/tiny.yaml", [
        f"model.d_model={d}", f"model.d_ff={4 * d}", f"model.d_kv={d // 4}", "model.num_layers=4",
        "model.num_decoder_layers=4", "model.vocab_size=32128", "train.micro_batch=1", "train.global_batch=1"])
    dims = init_distributed(ParallelConfig(), cfg.run.seed)
    model = build_model(cfg.model)
    engine = build_engine(model, cfg.train, cfg.zero, "fp32", 1)
    ids = torch.randint(2, 1000, (1, 16))

    def step() -> None:
        engine.backward(engine(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :4],
                               labels=ids[:, 1:5]).loss)
        engine.step()

    step()
    return cfg, dims, model, engine, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256, help="model width (d_ff = 4x, 4 layers, 32128 ids)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    cfg, dims, model, engine, _ = wide_engine(args.d_model)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tokenizer = Path(tmp) / "spiece.model"
        tokenizer.write_bytes(os.urandom(800_000))  # the size of T5's 32k-piece spiece.model
        manager = CheckpointManager(cfg.checkpoint, Path(tmp) / "checkpoints", dims, engine=engine,
                                    progress=Progress(), data=None, inputs=RunInputs.of(tokenizer),
                                    config_yaml="", universal_info=universal_checkpoint_info(model, 32128))
        saves, checksums, size = [], [], 0
        for step in range(1, args.saves + 1):
            start = time.perf_counter()
            path = manager.save(step)
            saves.append(time.perf_counter() - start)
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "complete.json")
            size = sum(f.stat().st_size for f in files)
            start = time.perf_counter()
            describe(path, files)  # what save() spends on checksums (the files are in the page cache, as there)
            checksums.append(time.perf_counter() - start)
    save_s, checksum_s = statistics.median(saves), statistics.median(checksums)
    print(f"checkpoint {size / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"fp32 Adam ZeRO 1, {len(files)} files): save {save_s:.2f} s (median of {args.saves}), of which "
          f"checksums {checksum_s:.2f} s ({checksum_s / save_s:.0%}, {size / checksum_s / 1e9:.2f} GB/s); "
          f"crc32 in memory {_crc32_rate() / 1e9:.2f} GB/s")
    destroy_distributed()


if __name__ == "__main__":
    main()
