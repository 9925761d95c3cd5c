"""Pretrained weights into a model already built on its device, one tensor at a time: an export of this project
(`python -m pretrain.export`) or a HuggingFace T5 v1.1 folder (`config.json` + `model.safetensors`, or shards
named by `model.safetensors.index.json`). Pretraining's `init=` and fine-tuning's `init=` both load through here.

Each of our parameters is made from its HF tensors (`hf_convert.hf_sources`; a Synthesizer parameter sits under
the HF self-attention module, as the export writes it), read with `safetensors.safe_open` in fp32, cut to this
rank's TP slice and copied into the parameter: the host holds one full parameter at a time, never the model
(peak host memory in docs/transfer.md). A parameter the folder lacks keeps the model's own initialisation (drawn
from the run's seed) and is reported as fresh; one it holds in another shape is refused (a vocabulary's rows apart,
`init_resize_vocab`).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pretrain.core.config import ModelConfig, UsageError, saved_model_config
from pretrain.core.manifest import mismatched
from pretrain.model.hf_convert import Source, hf_sources, vanilla_layout
from pretrain.model.sharding import VOCAB_PARAMETERS, copy_full_parameter, is_tp_sharded
from pretrain.model.t5 import T5Model
from tokenizer.spm import SPIECE, tokenizer_file

log = logging.getLogger(__name__)

WEIGHTS, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
# The export marks its weights files (safetensors metadata) and names the mark in config.json: files without it were
# written since by another tool (HF's save_pretrained, a Trainer's save_model), which keeps config.json's
# `synthesizer` section, checksums included, but not the weights those checksums are of
EXPORT_MARK = {"written_by": "pretrain.export"}
LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.attn\.(.+)$")  # our self-attention parameters
# HF config keys that no tensor shape shows but that change the function: (HF key, our key, T5 v1.1's value)
_FUNCTION_KEYS = (("relative_attention_max_distance", "relative_attention_max_distance"),
                  ("layer_norm_epsilon", "layer_norm_eps"))


def self_attention_hf_name(name: str) -> str | None:
    """The HF name of one of our self-attention parameters outside T5's layout (a Synthesizer part, or the V of a
    layer without dot-product attention): `encoder.layers.3.attn.synth.random.r` ->
    `encoder.block.3.layer.0.SelfAttention.synth.random.r`; None for other names."""
    m = LAYER.match(name)
    return f"{m.group(1)}.block.{m.group(2)}.layer.0.SelfAttention.{m.group(3)}" if m else None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index names, else model.safetensors."""
    if (folder / INDEX).is_file():
        files = [folder / name for name in sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))]
    else:
        files = [folder / WEIGHTS]
    for f in files:
        if not f.is_file():
            raise UsageError(f"{folder} is not a complete weights folder: {f.name} is missing (an export of "
                             f"python -m pretrain.export, or a HuggingFace T5 folder saved with save_pretrained)")
    return files


def _config_json(folder: Path) -> dict:
    if not (folder / CONFIG).is_file():
        raise UsageError(f"{folder} is not a weights folder: {CONFIG} is missing (make one with python -m "
                         f"pretrain.export, or give a HuggingFace T5 folder)")
    return json.loads((folder / CONFIG).read_text())


def export_config(folder: str | Path) -> ModelConfig:
    """The model config of one of our exports (its config.json's `synthesizer.model`), after checking the crc32 of
    its weights and tokenizer files against the ones it lists. A folder saved from an export by HF's
    `save_pretrained` or Trainer (weights without the export's mark; the tokenizer perhaps as tokenizer.json alone)
    is read too: the export's checksums are not of its files."""
    folder = Path(folder)
    config = _config_json(folder)
    if "synthesizer" not in config:
        raise UsageError(f"{folder / CONFIG} has no 'synthesizer' section: not written by pretrain.export")
    tokenizer_file(folder)
    weights = weight_files(folder)  # every weights file is there
    section = config["synthesizer"]
    resaved = [f.name for f in weights if "weights_mark" in section and not _marked(f, section["weights_mark"])]
    if "files" not in section:
        log.warning("%s lists no checksums (exported before they were recorded): its files are not checked", folder)
    elif resaved:
        log.info("%s: %s saved since the export (not by pretrain.export): the export's checksums are not checked",
                 folder, ", ".join(resaved))
    elif damaged := mismatched(folder, section["files"], [n for n in section["files"] if (folder / n).is_file()]):
        raise UsageError(f"export {folder} is damaged: {', '.join(damaged)}; export the checkpoint again")
    return saved_model_config(section["model"])


def _marked(file: Path, mark: dict[str, str]) -> bool:
    """Whether the export wrote `file`; a header safetensors cannot read counts as the export's: the checksums
    then name the file as damaged."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return mark.items() <= (f.metadata() or {}).items()
    except Exception:  # safetensors' own error types for a damaged header
        return True


@dataclass(frozen=True)
class LoadReport:
    """What a load did: our parameters read from the folder, those that kept their initialisation, and the
    folder's tensors no parameter used (HF's copies of the embedding under encoder/decoder.embed_tokens aside)."""
    folder: str
    loaded: list[str]
    fresh: list[str]
    unused: list[str]
    vocab_rows: dict[str, int]  # the folder's token rows of the vocabulary parameters


class WeightFolder:
    """A folder's tensors by name, each read on demand from its file. The file is opened for each tensor:
    safe_open maps the whole file, and the pages a read touches stay in the resident set until it is closed
    (with one open handle, loading a model left the folder's size in RSS)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.where, self.shapes = folder, {}, {}
        for path in weight_files(folder):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    self.where[name], self.shapes[name] = path, tuple(f.get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name).float()


def _source(name: str, vanilla: dict[str, Source]) -> Source:
    if name in vanilla:
        return vanilla[name]
    hf = self_attention_hf_name(name)
    return ((hf,), lambda ts: ts[0]) if hf else ((name,), lambda ts: ts[0])


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """The TP 1 shape of a parameter of a TP `tp` model (vocabulary parameters: any number of rows, compared apart)."""
    shape = list(param.shape)
    if is_tp_sharded(param):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def _check_shape(weights: WeightFolder, name: str, names: tuple[str, ...], combine, expected: tuple[int, ...],
                 vocab: bool) -> None:
    """The folder's tensors for parameter `name` must combine to its shape (judged on `meta`, nothing is read); a
    vocabulary parameter may have any number of rows (compared apart). A tensor of another shape is a model of
    another size: loading the rest would start every weight that matters fresh while the run looks continued."""
    try:
        shape = tuple(combine([torch.empty(weights.shapes[n], device="meta") for n in names]).shape)
    except RuntimeError:  # a view the shapes do not allow
        shape = weights.shapes[names[0]]
    if (shape[1:] != expected[1:]) if vocab else (shape != expected):
        wanted = f"[*, {', '.join(map(str, expected[1:]))}] (any number of rows)" if vocab else str(list(expected))
        raise UsageError(f"init={weights.folder} holds {names[0]} of shape {list(shape)}, the model's {name} is "
                         f"{wanted}: set the model.* keys to the folder's {CONFIG} (the first tensor of another "
                         "shape; none is loaded)")


def _plan(model: T5Model, weights: WeightFolder, resize_vocab: bool) -> tuple[dict[str, Source], LoadReport]:
    vanilla = hf_sources(vanilla_layout(model.config))
    plan, fresh, rows = {}, [], {}
    for name, param in model.named_parameters():
        names, combine = _source(name, vanilla)
        vocab = name in VOCAB_PARAMETERS
        if not all(n in weights.where for n in names):
            fresh.append(name)
            continue
        _check_shape(weights, name, names, combine, _full_shape(param, model.tp), vocab)
        if vocab:
            rows[name] = weights.shapes[names[0]][0]
            if rows[name] != model.config.vocab_size and not resize_vocab:
                raise UsageError(
                    f"{weights.folder} has {rows[name]} token rows in {names[0]}, the model {model.config.vocab_size} "
                    f"(the tokenizer's ids, or model.vocab_size): set model.vocab_size={rows[name]} if it is the "
                    f"same vocabulary padded (T5's 32128 rows for 32100 ids), or init_resize_vocab=true to keep the "
                    f"rows that fit and draw the others fresh")
        plan[name] = (names, combine)
    used = {n for names, _ in plan.values() for n in names}
    unused = sorted(n for n in weights.where if n not in used and not n.endswith("embed_tokens.weight"))
    return plan, LoadReport(str(weights.folder), sorted(plan), fresh, unused, rows)


def check_init_folder(folder: Path, cfg: ModelConfig, tokenizer: Path | None, resize_vocab: bool) -> None:
    """Settings no tensor shape shows must agree (FFN activation, relative-position distance, norm epsilon), and
    a folder that ships a tokenizer must ship the run's (unless `resize_vocab`: a vocabulary knowingly changed)."""
    config = _config_json(folder)
    activation = config.get("feed_forward_proj", "gated-gelu")
    if activation != "gated-gelu":
        raise UsageError(f"{folder / CONFIG} has feed_forward_proj '{activation}'; this model is T5 v1.1's "
                         f"gated-gelu (T5 v1.0 checkpoints such as t5-small do not load; use a v1.1 one)")
    for hf_key, key in _FUNCTION_KEYS:
        if hf_key in config and config[hf_key] != getattr(cfg, key):
            raise UsageError(f"{folder / CONFIG} has {hf_key} {config[hf_key]}, the model {getattr(cfg, key)}: "
                             f"set model.{key}={config[hf_key]}")
    spiece = foreign_tokenizer(folder, tokenizer) if tokenizer and not resize_vocab else None
    if spiece:
        raise UsageError(f"{spiece} is not data.tokenizer ({tokenizer}): the token ids would mean other pieces; "
                         f"set data.tokenizer={spiece} (and prepare the shards with it), or init_resize_vocab=true")


def foreign_tokenizer(folder: Path, tokenizer: Path) -> Path | None:
    """The folder's spiece.model when it ships one that is not `tokenizer` (byte for byte: another file with the
    same number of pieces loads without a shape error, and every token id then means another piece), else None."""
    spiece = folder / SPIECE
    return spiece if spiece.is_file() and spiece.read_bytes() != tokenizer.read_bytes() else None


@torch.no_grad()
def load_weights(model: T5Model, folder: str | Path, strict: bool = False, resize_vocab: bool = False) -> LoadReport:
    """Copy every tensor of `folder` that fits into this rank's shards of `model` (any TP, on any device), one
    parameter at a time (its full TP 1 fp32 value on the host, then this rank's slice); all TP ranks read the same
    folder, each keeping its slice. `strict`: every parameter must come from the folder (an export of this model)."""
    weights = WeightFolder(Path(folder))
    plan, report = _plan(model, weights, resize_vocab)
    if not report.loaded or (strict and report.fresh):
        raise UsageError(f"{folder} does not match the model config: missing {report.fresh[:3]}, unexpected "
                         f"{report.unused[:3]} (compare model.* with its {CONFIG})")
    for name, (sources, combine) in plan.items():
        copy_full_parameter(model, name, combine([weights.read(n) for n in sources]))
    return report
