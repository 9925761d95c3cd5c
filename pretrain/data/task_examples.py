"""A task's labelled examples as fine-tuning's training micro batches: tokenized once (`tokenize`), checked
against the layout (`check_examples`), and streamed by DP rank in a resumable order (`ExampleStream`, `collate`:
variable-length batches, padded as pretraining's stream pads, pretrain.data.stream).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch

from pretrain.core.config import UsageError
from pretrain.core.finetune_config import TaskConfig
from pretrain.data.stream import pad_pairs, shift_right
from tokenizer.spm import Tokenizer


class Labelled(Protocol):
    """A task's example (pretrain.tasks.Example, a package below this one): input text and target text."""

    inputs: str
    target: str


def check_examples(num_examples: int, file: Path, task: TaskConfig, micro_batch: int, dp: int) -> None:
    """Every DP rank's first micro batch must be full: fewer examples is a user's mistake, refused in one line
    (identical on every rank) before the lock or the export is touched."""
    if num_examples < micro_batch * dp:
        kept = f" (task.train_examples={task.train_examples})" if task.train_examples else ""
        raise UsageError(f"task {task.name}: {file}{kept} gives {num_examples} training examples, fewer than one micro "
                         f"batch on every DP rank: train.micro_batch ({micro_batch}) x DP ({dp}) = {micro_batch * dp}; "
                         "add examples or lower train.micro_batch")


class ExampleStream:
    """Endless micro batches of this DP rank: each epoch a permutation seeded by (seed, epoch), cut into
    global batches of micro x DP examples, of which DP rank r takes the r-th micro slice. Resumable on any layout
    of the same global batch: the position is counted in examples."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], micro: int, dp_rank: int, dp: int, seed: int):
        assert len(rows) >= micro * dp, "check_examples refuses a training set smaller than one micro batch x DP"
        self.rows, self.micro, self.dp_rank, self.dp, self.seed = rows, micro, dp_rank, dp, seed
        self.epoch, self.position = 0, 0  # position: global micro-batch slices consumed in this epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "examples": self.position * self.micro * self.dp}

    def load_state_dict(self, state: dict) -> None:
        """`{"ranks": [...]}`: every saved DP rank holds the same global position (examples of this epoch)."""
        saved = state["ranks"][0]
        self.epoch, self.position = saved["epoch"], saved["examples"] // (self.micro * self.dp)

    def close(self) -> None:
        """Nothing to release: the rows are in memory (pretraining's loader stops its workers here)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        per_slice = self.micro * self.dp
        while True:
            order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            while (self.position + 1) * per_slice <= len(self.rows):
                start = self.position * per_slice + self.dp_rank * self.micro
                self.position += 1
                yield collate([self.rows[i] for i in order[start : start + self.micro].tolist()])
            self.epoch, self.position = self.epoch + 1, 0


def collate(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Padded to the batch's longest input and target: inputs with 0, labels with IGNORE_INDEX; decoder inputs =
    labels shifted right from 0."""
    input_ids, labels = pad_pairs(rows, max(len(i) for i, _ in rows), max(len(t) for _, t in rows))  # [b, n], [b, m]
    return {"input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy((input_ids != 0).astype(np.int64)),
            "decoder_input_ids": torch.from_numpy(shift_right(labels)), "labels": torch.from_numpy(labels)}


def tokenize(examples: Sequence[Labelled], tokenizer: Tokenizer,
             max_input_length: int) -> list[tuple[list[int], list[int]]]:
    """(input ids truncated to max_input_length with EOS, target ids with EOS) per example."""
    inputs = tokenizer.encode_batch([e.inputs for e in examples])
    targets = tokenizer.encode_batch([e.target for e in examples])
    eos = tokenizer.eos_id
    return [(i[: max_input_length - 1] + [eos], t + [eos]) for i, t in zip(inputs, targets)]
