"""What a run shows besides scalars: the learned synthesizer matrices and per-head mixture weights as
TensorBoard images (read back from the event files), the config as text, a tokens-seen axis, the optional
W&B mirror in offline mode (no network), and the attention maps the study draws."""
from __future__ import annotations

import dataclasses
import io
import json
import socket
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.core.config import ModelConfig
from pretrain.model import build_local_model
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.pictures import (
    attention_maps,
    mixture_grids,
    synthesizer_figures,
    synthesizer_images,
    synthesizer_matrices,
)

TINY = ModelConfig(vocab_size=256, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=1,
                   max_length=16, relative_attention_num_buckets=8, relative_attention_max_distance=16)


def _model(encoder: str, decoder: str, per_head: bool = False, seed: int = 0, position_bias: str = "all"):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(TINY, encoder_attention=encoder, decoder_attention=decoder, mixture_per_head=per_head,
                              position_bias=position_bias)
    return build_local_model(cfg).eval()


def test_synthesizer_matrices_are_the_logits_the_modules_produce() -> None:
    model = _model("factorized_random+vanilla", "random")
    matrices = synthesizer_matrices(model.state_dict())
    assert list(matrices) == ["encoder.layers.0/factorized_random", "encoder.layers.1/factorized_random",
                              "decoder.layers.0/random"]
    x = torch.zeros(1, TINY.max_length, TINY.d_model)  # input-independent mixers ignore x
    for tag, r in matrices.items():
        stack, layer, mixer = tag.split("/")[0].split(".")[0], int(tag.split(".")[2].split("/")[0]), tag.split("/")[1]
        module = getattr(model, stack).layers[layer].attn.synth[mixer]
        assert r.shape == (TINY.num_heads, TINY.max_length, TINY.max_length)
        torch.testing.assert_close(r, module(x, 0, TINY.max_length)[0].detach())


def test_mixture_grid_is_the_softmax_of_each_heads_weights() -> None:
    model = _model("random+vanilla", "dense+vanilla", per_head=True)
    with torch.no_grad():
        for i, layer in enumerate(model.encoder.layers):
            layer.attn.mix.copy_(torch.arange(8.0).view(4, 2) * (i + 1) / 4)
    grids = mixture_grids(model)
    assert set(grids) == {"encoder/random", "encoder/vanilla", "decoder/dense", "decoder/vanilla"}
    assert grids["encoder/random"].shape == (2, 4)  # layers x heads
    for i in range(2):
        w = torch.arange(8.0).view(4, 2) * (i + 1) / 4
        expected = torch.exp(w) / torch.exp(w).sum(-1, keepdim=True)
        np.testing.assert_allclose(grids["encoder/random"][i], expected[:, 0].numpy(), rtol=1e-6)
        np.testing.assert_allclose(grids["encoder/vanilla"][i], expected[:, 1].numpy(), rtol=1e-6)
    assert grids["decoder/dense"].shape == (1, 4)


def _decode(encoded: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB"))


def test_tensorboard_images_text_and_tokens_axis_read_back(tmp_path: Path) -> None:
    model = _model("random+vanilla", "factorized_random")
    images = synthesizer_images(model)
    assert set(images) == {"synthesizer/encoder.layers.0/random", "synthesizer/encoder.layers.1/random",
                           "synthesizer/decoder.layers.0/factorized_random", "mixture_heads/encoder/random",
                           "mixture_heads/encoder/vanilla"}
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.write_text("config", "model:\n  d_model: 32\n")
    logger.write(5, {"loss": 3.5}, tokens_seen=640)
    logger.write(10, {"loss": 2.5}, tokens_seen=1280)
    logger.write_images(10, images)
    logger.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0}).Reload()
    assert sorted(events.Tags()["images"]) == sorted(images)
    for tag, image in images.items():
        (event,) = events.Images(tag)
        assert event.step == 10
        np.testing.assert_array_equal(_decode(event.encoded_image_string), image)  # PNG is lossless
    # drawn as a person reads them: layer 0's R as one labelled heatmap per head, exactly R, on the layer's one colour
    # scale with its colour bar; the mixture weights (learned-looking: each layer's its own) as bars of exactly the
    # softmax weights, per head, on 0..1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".attn.mix"):
                p.copy_(torch.randn_like(p))
    figures = synthesizer_figures(model)
    r = synthesizer_matrices(model.state_dict())["encoder.layers.0/random"]
    fig = figures["synthesizer/encoder.layers.0/random"]
    heads = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heads] == [f"head {h}" for h in range(TINY.num_heads)]
    for h, ax in enumerate(heads):
        np.testing.assert_array_equal(ax.images[0].get_array(), r[h].numpy())
        assert ax.images[0].get_clim() == (float(r.min()), float(r.max()))
    assert [ax.get_ylabel() for ax in fig.axes if not ax.images] == ["logit"]  # the colour bar
    assert fig.get_suptitle() == "encoder.layers.0/random: learned logits per head"
    bars = figures["mixture_heads/encoder/random"].axes[0]
    np.testing.assert_allclose([[p.get_height() for p in c] for c in bars.containers],
                               mixture_grids(model)["encoder/random"], rtol=1e-6)
    assert [t.get_text() for t in bars.get_xticklabels()] == [f"head {h}" for h in range(TINY.num_heads)]
    assert bars.get_ylim() == (0, 1) and bars.get_ylabel() == "mixture weight"
    assert [(s.step, s.value) for s in events.Scalars("by_tokens/loss")] == [(640, 3.5), (1280, 2.5)]
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(5, 3.5), (10, 2.5)]
    (text,) = events.Tensors("config/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "    model:\n      d_model: 32\n"
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 5, "loss": 3.5, "tokens_seen": 640}, {"step": 10, "loss": 2.5, "tokens_seen": 1280}]


def test_wandb_offline_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path / "run", enabled=True, wandb="synthesizer-test", config={"model": {"d_model": 32}})
    logger.write(1, {"loss": 4.0})
    logger.write(2, {"loss": 3.0}, tokens_seen=256)
    logger.write_images(2, {"mixture_heads/encoder/random": np.zeros((8, 8, 3), dtype=np.uint8)})
    logger.write_text("config", "model:\n  d_model: 32\n", step=2)
    logger.close()
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    rows = _wandb_history(next(run.glob("*.wandb")))  # the offline log `wandb sync` uploads later
    assert [(r["_step"], r["loss"], r.get("tokens_seen")) for r in rows] == [(1, 4.0, None), (2, 3.0, 256)]
    assert rows[1]["mixture_heads/encoder/random/_type"] == "image-file"
    assert rows[1]["config/_type"] == "html-file"
    image = run / "files" / rows[1]["mixture_heads/encoder/random/path"]
    np.testing.assert_array_equal(np.asarray(Image.open(image).convert("RGB")), np.zeros((8, 8, 3), dtype=np.uint8))
    assert (run / "files" / rows[1]["config/path"]).read_text().endswith("<pre>model:\n  d_model: 32\n</pre>")


def test_wandb_without_a_login_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    # log.wandb=PROJECT on a machine with no W&B login: before, wandb.init's UsageError was a traceback on rank 0
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no stored key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with socket.socket() as s:  # a local port nobody listens on: nothing can leave the machine
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path / "run", enabled=True, wandb="synthesizer-test")
    logger.write(1, {"loss": 4.0})
    logger.close()
    assert ("log.wandb=synthesizer-test: W&B did not take the run (No API key configured. Use `wandb login` to log "
            f"in.); logging it offline in {tmp_path / 'run' / 'wandb'} instead") in caplog.text
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    assert [(r["_step"], r["loss"]) for r in _wandb_history(next(run.glob("*.wandb")))] == [(1, 4.0)]


def _wandb_history(path: Path) -> list[dict]:
    """History rows of an offline .wandb file: a LevelDB-style log (7-byte header, 32 KiB blocks of records
    with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) of wandb Record protos."""
    from wandb.proto import wandb_internal_pb2

    data, pos, part, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(part)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            part = b""
    return rows


def test_attention_maps_are_what_the_layer_applies() -> None:
    for encoder, position_bias in (("vanilla", "all"), ("dense", "all"), ("dense+vanilla", "all"),
                                   ("dense+vanilla", "vanilla"), ("dense", "none")):
        model = _model(encoder, "vanilla", seed=3, position_bias=position_bias)
        ids = torch.tensor([[5, 17, 33, 8, 90, 41, 7, 1]])
        maps = attention_maps(model, ids)
        assert set(maps) == {*encoder.split("+"), "mixed"}
        for m in maps.values():
            assert m.shape == (TINY.num_heads, 8, 8)
            torch.testing.assert_close(m.sum(-1), torch.ones(TINY.num_heads, 8))
        # the layer's output recomputed from the mixed probabilities: probs @ V, output projection
        attn = model.encoder.layers[0].attn
        x = model.encoder.layers[0].attn_norm(model.embed(ids))
        placement = model.encoder.bias_placement  # after mixing, on Q K^T before mixing, or none
        bias = model.encoder.relative_bias(8, 8) if placement else None
        with torch.no_grad():
            expected = attn(x, bias, None) if placement != "vanilla" else attn(x, None, None, None, bias)
            v = (attn.qkv(x).view(1, 8, 4, 3, 8)[:, :, :, 2] if "vanilla" in attn.mixers
                 else attn.v(x).view(1, 8, 4, 8)).transpose(1, 2)  # [1, heads, n, d_kv]
            out = (maps["mixed"][None] @ v).transpose(1, 2).reshape(1, 8, -1)
            torch.testing.assert_close(attn.o(out), expected, rtol=1e-5, atol=1e-6)
        if encoder == "vanilla":
            torch.testing.assert_close(maps["vanilla"], maps["mixed"])
