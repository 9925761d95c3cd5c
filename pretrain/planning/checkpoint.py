"""A checkpoint's size and save time, estimated for the planner: the bytes each rank writes, the whole
checkpoint's bytes, how long a save takes at a stated filesystem bandwidth, and the share of wall time the
configured `checkpoint.every` spends saving (synchronous saves, or `checkpoint.async_save`).

What DeepSpeed 0.19 writes (read from its `save_checkpoint`; tests/test_plan.py compares a real save's files):
- the weights as trained (fp32: 4 bytes, bf16/fp16: 2 bytes a parameter of the TP shard) in
  `mp_rank_{tp}_model_states.pt`, written by the first DP rank of each TP rank only; under ZeRO 3 each rank's
  file holds empty parameters, the weights living in the optimizer's fp32 partition;
- the optimizer: without ZeRO inside the same file on the same rank, whole (AdamW's m and v, 8 bytes, and for a
  half-precision model the fp32 master, 4 more; Adafactor its factors); with ZeRO 1-3 every DP rank writes its
  partition, `zero_pp_rank_{dp}_mp_rank_{tp}_optim_states.pt` (fp32 master + m + v, 12 bytes / DP): the
  optimizer states of pretrain.planning.memory, saved as held.
Ours (pretrain.runtime.checkpoint) beside them, small: every rank's generators, each DP rank's data position,
and on rank 0 the trainer state, config, inputs list and the tokenizer's copy.

A save blocks every rank until the slowest one (the first, which writes the weights too) has written, fsync'd
and checksummed its files (crc32, read back from the page cache). With `checkpoint.async_save` the loop waits
only for the copy of the rank's state into host memory; a thread writes it while training goes on, and the
next save waits for it when it is still writing (at most one in flight).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pretrain.planning.memory import model_state_bytes
from pretrain.planning.units import decimal_size

FS_GBPS = 1.0  # GB/s of filesystem write per rank (flag --fs-gbps): see FS_GBPS_WHY
FS_GBPS_WHY = ("a parallel filesystem (Lustre, GPFS, Weka) gives a client node ~5-10 GB/s, shared by its 8 ranks "
               "writing at once")
# a rank's device-to-host copy, counted whole as blocking at the pageable rate: PCIe 5 x16 moves ~25 GB/s into
# pinned memory, about half of that into pageable memory, and a node's 8 ranks share its DRAM. An upper bound for
# an async save: its copies go into pinned buffers on a side stream (pretrain.runtime.checkpoint_writer) that only
# the next optimizer step waits for; DeepSpeed's own copy of the weights (`.to("cpu")`) blocks
HOST_COPY_GBPS = 10.0
CRC32_GBPS = 3.0  # zlib's crc32 on one core, quiet (docs/training.md, "What checksums cost")
RNG_BYTES = 17_000  # rng_rank{r}.pt: CPU (and CUDA) generators and megatron's tracker, torch.save'd (17,185 on CPU)
DATA_BYTES = 4_000  # data_dp{r}.pt: the streams' positions and counts
RANK0_TEXT_BYTES = 100_000  # trainer_state.json, config.yaml (2 KB) and inputs.json: C4's 1024 shards listed
T5_TOKENIZER_BYTES = 791_656  # T5's spiece.model, when the run's tokenizer file is not at hand
WALL_SHARE_WARN = 0.05  # the share of wall time saving may take before the planner says so


@dataclass(frozen=True)
class CheckpointEstimate:
    """Bytes one checkpoint writes: per rank (the first rank writes the weights and rank 0's files too) and in all."""

    first_rank: int  # global rank 0: the TP shard's weights (ZeRO 0-2), its optimizer part, its small files
    other_rank: int  # a rank of DP rank > 0 (the same as the first at DP 1)
    total: int  # every rank's files


def checkpoint_bytes(num_params: int, precision: str, stage: int, tp: int, dp: int, optimizer: str,
                     factored_elements: int = 0, tokenizer_bytes: int = T5_TOKENIZER_BYTES) -> CheckpointEstimate:
    """What a save of this layout writes, for `num_params` parameters of one TP shard."""
    params, _, opt = model_state_bytes(num_params, precision, stage, dp, optimizer, factored_elements)
    weights = 0 if stage == 3 else params  # ZeRO 3: the weights are in the fp32 partition (not gathered to save)
    # without ZeRO the optimizer is whole, in the first DP rank's file; with it every rank writes its partition
    first_opt, other_opt = (opt, 0) if stage == 0 else (opt, opt)
    small = RNG_BYTES + DATA_BYTES
    first = weights + first_opt + small + RANK0_TEXT_BYTES + tokenizer_bytes
    other = other_opt + small if dp > 1 else first
    # each TP rank's first DP rank writes like rank 0 but for rank 0's own files; data positions: TP rank 0 only
    total = tp * (weights + first_opt + (dp - 1) * other_opt + dp * RNG_BYTES) + dp * DATA_BYTES \
        + RANK0_TEXT_BYTES + tokenizer_bytes
    return CheckpointEstimate(first, other, total)


@dataclass(frozen=True)
class SaveEstimate:
    """A save's seconds and the share of wall time `checkpoint.every` spends on them."""

    write_s: float  # the first rank's write + fsync + checksum (the slowest rank)
    copy_s: float  # the first rank's copy into host memory (what an asynchronous save blocks for)
    every: int
    step_s: float
    async_save: bool

    @property
    def interval_s(self) -> float:
        """Training time between two periodic saves."""
        return self.every * self.step_s

    @property
    def blocking_s(self) -> float:
        """What the loop waits per save: the whole save, or the host copy plus what the last save's write outlasts
        the steps between them (the next save waits for it)."""
        if not self.async_save:
            return self.copy_s + self.write_s  # torch.save copies a device tensor to the host as it writes
        return self.copy_s + max(0.0, self.write_s - self.interval_s)

    @property
    def wall_share(self) -> float:
        return self.blocking_s / (self.interval_s + self.blocking_s) if self.every else 0.0

    def every_for(self, share: float) -> int:
        """The smallest checkpoint.every whose saves block for at most `share` of wall time."""
        # blocking at this every, spread over enough steps, is under `share` (and blocking only falls as every grows:
        # an asynchronous write outlasts a longer interval less); the share falls with every: bisect below that
        high = max(1, -int(-self.blocking_s * (1 - share) // (share * self.step_s)))
        low = 0  # share(low) > share, share(high) <= share
        while high - low > 1:
            mid = (low + high) // 2
            if dataclasses.replace(self, every=mid).wall_share <= share:
                high = mid
            else:
                low = mid
        return high


def estimate_save(ckpt: CheckpointEstimate, every: int, step_s: float, async_save: bool,
                  fs_gbps: float = FS_GBPS) -> SaveEstimate:
    return SaveEstimate(write_s=ckpt.first_rank / (fs_gbps * 1e9) + ckpt.first_rank / (CRC32_GBPS * 1e9),
                        copy_s=ckpt.first_rank / (HOST_COPY_GBPS * 1e9), every=every, step_s=step_s,
                        async_save=async_save)


def describe_checkpoint(ckpt: CheckpointEstimate, save: SaveEstimate, dp: int, fs_gbps: float) -> list[str]:
    """The planner's lines for the checkpoint."""
    others = f", {decimal_size(ckpt.other_rank)} on each rank of DP rank > 0" if dp > 1 else ""
    lines = [f"checkpoint: {decimal_size(ckpt.first_rank)} on rank 0{others}, {decimal_size(ckpt.total)} in all; save "
             f"{save.copy_s + save.write_s:.1f} s (host copy {HOST_COPY_GBPS:g} GB/s, write {fs_gbps:g} GB/s per rank, "
             f"crc32 {CRC32_GBPS:g} GB/s)"]
    if not save.every:
        lines.append("  checkpoint.every 0: saves only at the end of the run")
    elif save.async_save:
        waits = "host copy" if save.blocking_s <= save.copy_s else "host copy + the last write's rest"
        lines.append(f"  checkpoint.every {save.every} x step {save.step_s:.3f} s = {save.interval_s:.1f} s between "
                     f"saves; async: blocks {save.blocking_s:.2f} s ({waits}), write in the background "
                     f"{save.write_s:.1f} s = {save.write_s / save.interval_s:.1%} of the interval; "
                     f"{save.wall_share:.2%} of wall time blocked")
    else:
        lines.append(f"  checkpoint.every {save.every} x step {save.step_s:.3f} s = {save.interval_s:.1f} s between "
                     f"saves; sync: blocks {save.blocking_s:.1f} s, {save.wall_share:.2%} of wall time")
    return lines


def warning(save: SaveEstimate, steps: int) -> str | None:
    """One line when saving takes more than WALL_SHARE_WARN of wall time, naming what brings it under within the
    run's `steps` (a cadence beyond them is no periodic save at all: checkpoint.every=0 says so)."""
    if save.wall_share <= WALL_SHARE_WARN:
        return None
    every = save.every_for(WALL_SHARE_WARN)
    fix = (f"set checkpoint.every={every}" if every < steps
           else f"set checkpoint.every=0 (one save, at the end of the {steps} steps)")
    if not save.async_save:
        fix += " or checkpoint.async_save=true"
    return (f"warning: checkpoint.every {save.every} spends {save.wall_share:.1%} of wall time saving "
            f"({save.blocking_s:.1f} s blocked every {save.interval_s:.1f} s), over {WALL_SHARE_WARN:.0%}; {fix}")
