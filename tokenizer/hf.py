"""HuggingFace's tokenizer.json in the role of the SentencePiece processor that `tokenizer.spm.Tokenizer` wraps,
for folders without a spiece.model: a model saved by HF's Trainer (`save_model`) or `save_pretrained` under
transformers 5, whose T5 tokenizer writes tokenizer.json and tokenizer_config.json only. The file holds the same
unigram pieces, normalizer and sentinels, so the ids are spiece.model's (tests/test_tokenizer.py)."""
from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

from pretrain.core.config import UsageError

_SENTINEL = re.compile(r"<extra_id_\d+>")
_UNK_SURFACE = " \u2047 "


class HFPieces:
    """The part of `sentencepiece.SentencePieceProcessor` that Tokenizer uses, read from a tokenizer.json; its
    pieces are the ids below the sentinels, which HF's T5 tokenizer appends on top as T5 does."""

    def __init__(self, path: Path) -> None:
        try:
            self.tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library's parse errors are of its own types
            raise UsageError(f"{path} is not a HuggingFace tokenizer.json ({str(e).splitlines()[0]})") from None
        self.tok.no_truncation()
        self.tok.no_padding()
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.num_pieces = len(vocab) - sum(1 for piece in vocab if _SENTINEL.fullmatch(piece))
        top = [vocab.get(f"<extra_id_{i}>") for i in range(len(vocab) - self.num_pieces)]
        if top != list(range(len(vocab) - 1, self.num_pieces - 1, -1)):
            raise UsageError(f"{path} does not hold T5's sentinels <extra_id_0> ... at the top ids, counting down")

    def encode(self, text: str | list[str], num_threads: int = 1) -> list[int] | list[list[int]]:
        """Ids without EOS (HF's post-processor adds it; sentencepiece does not)."""
        if isinstance(text, str):
            return self.tok.encode(text, add_special_tokens=False).ids
        return [e.ids for e in self.tok.encode_batch(text, add_special_tokens=False)]

    def get_piece_size(self) -> int:
        return self.num_pieces

    def id_to_piece(self, i: int) -> str:
        return self.tok.id_to_token(i)

    def decode_pieces(self, pieces: list[str]) -> str:
        """Text of `pieces`; unk reads " ⁇ " as sentencepiece writes it (its default unk_surface), not "<unk>"."""
        return self.tok.decoder.decode([_UNK_SURFACE if p == "<unk>" else p for p in pieces])

    def _id(self, piece: str) -> int:
        found = self.tok.token_to_id(piece)
        return -1 if found is None else found

    def pad_id(self) -> int:
        return self._id("<pad>")

    def eos_id(self) -> int:
        return self._id("</s>")

    def unk_id(self) -> int:
        return self._id("<unk>")

    def bos_id(self) -> int:
        return self._id("<s>")
