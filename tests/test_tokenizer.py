"""Tokenizer: T5's special ids and sentinels, round trips on real text, the training CLI's user errors."""
import gzip
import json
import subprocess
import sys

import pytest
import sentencepiece as spm

from tokenizer.spm import Tokenizer
from tokenizer.train import train


def test_special_ids_and_sentinels(tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert (tok.pad_id, tok.eos_id, tok.unk_id, sp.bos_id()) == (0, 1, 2, -1)
    assert tok.num_pieces == sp.get_piece_size() == 1000
    assert tok.num_ids == 1100
    assert [tok.sentinel_id(i) for i in (0, 1, 99)] == [1099, 1098, 1000]  # <extra_id_0> is the highest id
    with pytest.raises(ValueError, match="sentinel index 100"):
        tok.sentinel_id(100)


def test_round_trip_on_real_text(tokenizer_model, c4_dir):
    tok = Tokenizer(tokenizer_model)
    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    with gzip.open(c4_dir / "c4-validation.00000-of-00001.json.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f][:50]
    batch = tok.encode_batch(texts)
    assert batch == [sp.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert all(max(ids) < tok.num_pieces for ids in batch)
    # sentencepiece normalises whitespace (NFKC, runs of spaces); compare on its own normal form
    assert [tok.decode(ids) for ids in batch] == [sp.decode(sp.encode(t)) for t in texts]
    assert sum(map(len, batch)) < sum(map(len, texts)) / 2  # a real vocabulary: well under 2 chars per id


def test_sentinels_in_text_encode_and_decode(tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    ids = tok.encode("The court <extra_id_0> the case <extra_id_7>.")
    assert tok.sentinel_id(0) in ids and tok.sentinel_id(7) in ids
    # text after a sentinel gets sentencepiece's word-start marker, as in T5's own (legacy) tokenizer
    text = tok.decode(ids + [tok.eos_id, tok.pad_id])
    assert text == "The court<extra_id_0> the case<extra_id_7> ."
    assert tok.encode(text) == ids


def test_rejects_a_model_without_t5_ids(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"line {i} of some text for a toy model" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "m"), vocab_size=40, minloglevel=2)
    with pytest.raises(ValueError, match=r"pad/eos/unk/bos ids .* T5 needs \(0, 1, 2, -1\)"):
        Tokenizer(tmp_path / "m.model")
    with pytest.raises(ValueError, match="tokenizer model not found"):
        Tokenizer(tmp_path / "missing.model")


def test_train_writes_t5_layout_from_a_byte_budget(c4_dir, tmp_path):
    files = sorted(str(p) for p in c4_dir.glob("c4-train.*.json.gz"))
    model = train(files, tmp_path, vocab_size=300, max_bytes=150_000, seed=0)
    tok = Tokenizer(model)
    assert (tok.num_pieces, tok.num_ids) == (300, 400)


def test_cli_glob_matching_nothing_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tokenizer.train", "--input", str(tmp_path / "*.json.gz"),
                        "--output", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("python -m tokenizer.train: error: no files match")
    assert "Traceback" not in r.stderr
