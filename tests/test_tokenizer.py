"""Tokenizer: T5's special ids and sentinels, round trips on real text, every input format, the training CLI's
user errors and advice (bad text, CJK/emoji text that needs more pieces than the vocabulary holds)."""
import gzip
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from bench.documents import write_formats
from tests.test_documents import real_documents
from tokenizer.spm import Tokenizer
from tokenizer.train import main, train


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
    assert str(tmp_path).encode() not in model.read_bytes()  # exports ship it: no path of this machine inside


def test_huggingface_tokenizer_json_gives_the_spiece_ids(tokenizer_model, c4_dir, tmp_path):
    # a folder HF saved (a Trainer's save_model under transformers 5) has tokenizer.json and no spiece.model
    from pretrain.transfer.hf_files import write_tokenizer

    write_tokenizer(Path(tokenizer_model), tmp_path, 64)  # an export's tokenizer files
    (tmp_path / "spiece.model").unlink()
    ours, hf = Tokenizer(tokenizer_model), Tokenizer(tmp_path)
    assert hf.path.name == "tokenizer.json"
    assert (hf.num_pieces, hf.num_ids, hf.pad_id, hf.eos_id, hf.unk_id) == (1000, 1100, 0, 1, 2)
    with gzip.open(c4_dir / "c4-validation.00000-of-00001.json.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f][:50]
    texts += ["fox <extra_id_0> over  12 <extra_id_99>x", "émigré naïve \U0001F600 \u2047", "", "  padded  "]
    assert hf.encode_batch(texts) == ours.encode_batch(texts)
    assert [hf.encode(t) for t in texts] == [ours.encode(t) for t in texts]
    assert [hf.decode(ours.encode(t)) for t in texts] == [ours.decode(ours.encode(t)) for t in texts]
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer: neither spiece.model nor HuggingFace's tokenizer.json"):
        Tokenizer(tmp_path)


def test_cli_glob_matching_nothing_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tokenizer.train", "--input", str(tmp_path / "*.json.gz"),
                        "--output", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("python -m tokenizer.train: error: no files match")
    assert "Traceback" not in r.stderr


def _pieces(model) -> list[tuple[str, float]]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def test_every_format_trains_the_same_model(c4_dir, tmp_path):
    formats = write_formats(real_documents(c4_dir), tmp_path / "in")
    want = _pieces(train([str(c4_dir / "c4-validation.00000-of-00001.json.gz")], tmp_path / "c4", vocab_size=300))
    for name in ("jsonl.gz", "parquet", "text blocks"):  # blocks: the same lines as the originals
        path, layout = formats[name]
        assert _pieces(train([str(path)], tmp_path / name, vocab_size=300, layout=layout)) == want, name


def test_a_lone_surrogate_is_counted_and_skipped(c4_dir, tmp_path, caplog):
    """A document holding "\\ud800" (valid JSON) failed training with the advice to lower --vocab-size."""
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    with gzip.open(c4_dir / "c4-validation.00000-of-00001.json.gz", "rb") as f:
        lines = f.read().splitlines(keepends=True)
    with gzip.open(path, "wb") as f:
        f.writelines(lines[:50] + [b'{"text": "half a pair \\ud800 of surrogates"}\n'] + lines[50:])
    main(["--input", str(path), "--output", str(tmp_path / "tok"), "--vocab-size", "300"])
    assert Tokenizer(tmp_path / "tok" / "spiece.model").num_pieces == 300
    assert "skipped bad input: {'lone_surrogate': 1}" in caplog.text


# Real sentences in Chinese, Japanese and Korean with emoji; documents are fragments of them drawn with Zipf
# weights, so that, as in real CJK text, a long tail of rare characters decides how many pieces coverage needs.
CJK_SENTENCES = [
    "今天天气很好，我们去公园散步吧。🌞", "法院今天就这起上诉案件作出了判决。⚖️", "東京の桜は三月の終わりに咲き始めます。🌸",
    "我喜欢在周末读书和喝茶。📚🍵", "这家餐厅的饺子非常好吃！🥟😋", "研究人员发现了一种新的蛋白质结构。🔬",
    "明日は雨が降るかもしれないので、傘を持って行ってください。☔", "火车站离这里大约有两公里。🚉",
    "彼女は毎朝六時に起きてジョギングをします。🏃‍♀️", "这本小说讲述了一个关于友谊和勇气的故事。❤️",
    "서울의 겨울은 매우 춥습니다. ❄️", "会议将于下周三下午两点在三楼举行。📅", "猫がソファの上で気持ちよさそうに寝ている。🐱💤",
    "他把自行车停在了图书馆门口。🚲", "新しいスマートフォンの電池は二日間持ちます。📱🔋", "孩子们在海边堆沙堡，玩得很开心。🏖️😄",
    "经济学家预计明年的增长率会略有下降。📉", "この町には古い神社がたくさんあります。⛩️", "我们的航班因为大雾推迟了三个小时。✈️🌫️",
    "请把窗户关上，外面风很大。🌬️", "박물관은 월요일에 문을 닫습니다. 🏛️", "医生建议他每天多喝水，早点睡觉。💧🛌",
]


def write_cjk(path, num_docs: int = 400) -> None:
    rng = random.Random(0)
    weights = [1 / (k + 1) for k in range(len(CJK_SENTENCES))]

    def fragment() -> str:
        sentence = rng.choices(CJK_SENTENCES, weights)[0]
        start = rng.randrange(len(sentence))
        return sentence[start : start + rng.randint(2, 8)]

    docs = ["".join(fragment() for _ in range(rng.randint(10, 40))) for _ in range(num_docs)]
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs))


def test_cjk_and_emoji_text_gets_one_piece_of_advice_that_works(tmp_path, capsys):
    """sentencepiece said "increase vocab_size or decrease character_coverage", the wrapper added "lower
    --vocab-size", and there was no flag for the coverage."""
    write_cjk(tmp_path / "cjk.jsonl")
    args = ["--input", str(tmp_path / "cjk.jsonl"), "--output", str(tmp_path / "tok")]
    with pytest.raises(SystemExit) as exit:
        main(args + ["--vocab-size", "250"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit.value.code == 2 and "lower --vocab-size" not in line
    m = re.fullmatch(r"python -m tokenizer.train: error: the characters that --character-coverage 0.9999 keeps need "
                     r"(\d+) pieces \(with pad, eos, unk\), more than --vocab-size 250: raise --vocab-size to \1 or "
                     r"more, or lower --character-coverage \(down to 0.98; the rarer characters then become unk\)",
                     line)
    assert m, line
    main(args + ["--vocab-size", m[1]])  # either change works
    assert Tokenizer(tmp_path / "tok" / "spiece.model").num_pieces == int(m[1])
    main(args + ["--vocab-size", "250", "--character-coverage", "0.98"])
    tok = Tokenizer(tmp_path / "tok" / "spiece.model")
    assert tok.num_pieces == 250 and tok.unk_id in tok.encode("".join(CJK_SENTENCES))  # the rarest became unk
    with pytest.raises(SystemExit):  # at its floor the coverage is no longer offered
        main(args + ["--vocab-size", "200", "--character-coverage", "0.98"])
    assert capsys.readouterr().err.strip().endswith("more than --vocab-size 200: raise --vocab-size to 239 or more")
    with pytest.raises(SystemExit):  # below sentencepiece's range: refused before reading anything
        main(args + ["--character-coverage", "0.9"])
    assert capsys.readouterr().err.strip().endswith("--character-coverage must be in [0.98, 1], got 0.9")


def test_a_file_the_reader_refuses_is_one_line(c4_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--input", str(c4_dir / "c4-validation.*.json.gz"), "--output", str(tmp_path), "--text-field", "body"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"python -m tokenizer.train: error: {c4_dir}/c4-validation.00000-of-00001.json.gz: no record has the text "
        "field 'body' (the first has fields text, timestamp, url); pass --text-field NAME")
