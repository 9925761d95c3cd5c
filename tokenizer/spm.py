"""The tokenizer every other part uses: a SentencePiece model plus T5's 100 sentinel ids on top.

Layout as T5 (and HuggingFace `T5Tokenizer(extra_ids=100)`): the model file holds the pieces, pad 0,
eos 1, unk 2, no BOS; `<extra_id_0>` is id num_pieces + 99 (the highest), `<extra_id_99>` is num_pieces.
A folder without spiece.model (one saved by HF's Trainer under transformers 5) is read from its tokenizer.json
(`tokenizer.hf`): the same pieces and ids.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import sentencepiece as spm

from pretrain.core.config import UsageError

NUM_SENTINELS = 100
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
SPIECE, HF_TOKENIZER = "spiece.model", "tokenizer.json"
_SENTINEL = re.compile(r"<extra_id_(\d+)>")


def tokenizer_file(folder: str | Path) -> Path:
    """A model folder's tokenizer: its spiece.model, else the tokenizer.json HF writes (a Trainer's save_model,
    or save_pretrained under transformers 5, writes no spiece.model)."""
    folder = Path(folder)
    for name in (SPIECE, HF_TOKENIZER):
        if (folder / name).is_file():
            return folder / name
    raise UsageError(f"{folder} has no tokenizer: neither {SPIECE} nor HuggingFace's {HF_TOKENIZER} (make one with "
                     "python -m pretrain.export, or save the tokenizer beside the model)")


class Tokenizer:
    """Encode/decode text; ids of the special tokens and sentinels; the number of ids a model must hold."""

    pad_id = PAD_ID
    eos_id = EOS_ID
    unk_id = UNK_ID

    def __init__(self, path: str | Path):
        """`path`: a spiece.model, a HuggingFace tokenizer.json, or a folder holding one (`tokenizer_file`)."""
        path = Path(path)
        if path.is_dir():
            path = tokenizer_file(path)
        if not path.is_file():
            raise UsageError(f"tokenizer model not found: {path}; train one with `python -m tokenizer.train`")
        self.path = path
        if path.name == HF_TOKENIZER:
            from tokenizer.hf import HFPieces

            self.sp = HFPieces(path)
        else:
            try:
                self.sp = spm.SentencePieceProcessor(model_file=str(path))
            except (RuntimeError, OSError) as e:  # sentencepiece's parse error for a file of another kind
                raise UsageError(f"{path} is not a SentencePiece model ({str(e).strip().splitlines()[0]}); point "
                                 "data.tokenizer at the spiece.model of `python -m tokenizer.train`") from None
        got = (self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id(), self.sp.bos_id())
        if got != (PAD_ID, EOS_ID, UNK_ID, -1):
            raise UsageError(
                f"{path} has pad/eos/unk/bos ids {got}, T5 needs (0, 1, 2, -1); retrain with `python -m tokenizer.train`"
            )
        self.num_pieces = self.sp.get_piece_size()
        self.num_ids = self.num_pieces + NUM_SENTINELS  # pieces + sentinels: the ids a model must embed

    def sentinel_id(self, i: int) -> int:
        """Id of `<extra_id_i>`: counting down from the top of the vocabulary."""
        if not 0 <= i < NUM_SENTINELS:
            raise ValueError(f"sentinel index {i} out of range [0, {NUM_SENTINELS})")
        return self.num_ids - 1 - i

    def encode(self, text: str) -> list[int]:
        """Ids of `text` (no EOS added); `<extra_id_N>` in the text becomes sentinel N."""
        if "<extra_id_" not in text:
            return self.sp.encode(text)
        ids: list[int] = []
        for k, part in enumerate(_SENTINEL.split(text)):
            if k % 2:
                ids.append(self.sentinel_id(int(part)))
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """`encode` for many texts at once (sentencepiece's batched C++ path when no sentinels occur)."""
        if any("<extra_id_" in t for t in texts):
            return [self.encode(t) for t in texts]
        return self.sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; pad and EOS are dropped, sentinels come out as `<extra_id_N>`."""
        pieces = [
            self.sp.id_to_piece(i) if i < self.num_pieces else f"<extra_id_{self.num_ids - 1 - i}>"
            for i in (int(i) for i in ids)
            if i not in (PAD_ID, EOS_ID)
        ]
        return self.sp.decode_pieces(pieces)
