"""Export a training checkpoint to one folder that HuggingFace and our downstream jobs load, and load it back.

    python -m pretrain.export --run RUN_DIR --output OUT [--step N] [--dtype fp32|bf16]

Input: `RUN_DIR/checkpoints/step_N/` (default: the tag named by `checkpoints/latest`) in DeepSpeed's sharded
layout at any TP, any ZeRO stage and any number of ranks. Each TP rank's fp32 weights are rebuilt from its ZeRO
shards by DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` (run on a view holding only that TP rank's
files, since the tool itself knows no TP), then the TP shards are concatenated as megatron's attributes on the
TP=1 model say (`partition_dim`, `partition_stride`).

Output (written to OUT.tmp, renamed to OUT only when complete): `model.safetensors` in HuggingFace's T5 names,
`config.json` (HF's T5Config plus `synthesizer`: our model config and the learned mixture weights),
`spiece.model`, `tokenizer.json` and `tokenizer_config.json` (T5Tokenizer/T5TokenizerFast load them). A
Synthesizer model keeps the HF layout for everything T5 has; its extra parameters (`mix`, `synth.*`) sit under
the HF self-attention module (`encoder.block.3.layer.0.SelfAttention.synth.random.r`) and a layer without
dot-product attention has only `SelfAttention.v`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from pretrain.config import ModelConfig
from pretrain.model import T5Model, build_local_model, full_state_dict, load_full_state_dict
from pretrain.model.attention import parse_mixers
from pretrain.model.hf_convert import from_hf_state_dict, hf_config, to_hf_state_dict

log = logging.getLogger(__name__)

WEIGHTS, CONFIG, SPIECE = "model.safetensors", "config.json", "spiece.model"
_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.attn\.(.+)$")
_HF_LAYER = re.compile(r"^(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.(.+)$")
_MP_RANK = re.compile(r"mp_rank_(\d+)_")
_DP_RANK = re.compile(r"zero_pp_rank_(\d+)_")


class CheckpointError(ValueError):
    """A checkpoint that is missing, partial or damaged; the message names the missing part."""


# --------------------------------------------------------------------------------------------------------
# Reading a training checkpoint
# --------------------------------------------------------------------------------------------------------
def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    if step is None:
        latest = root / "latest"
        if not latest.is_file():
            raise CheckpointError(f"{latest} not found: {run_dir} has no complete checkpoint; pass --step N")
        path = root / latest.read_text().strip()
    else:
        path = root / f"step_{step}"
    if not path.is_dir():
        tags = sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
        raise CheckpointError(f"checkpoint {path} not found; available: {', '.join(tags) or 'none'}")
    for part in ("config.yaml", "trainer_state.json"):
        if not (path / part).is_file():
            raise CheckpointError(f"{path} is partial: {part} is missing (the save did not finish)")
    return path


def _load(file: Path) -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or overwritten file: torch raises various types
        raise CheckpointError(f"{file} is damaged ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def _dp_ranks(files: list[Path]) -> set[int]:
    return {int(m.group(1)) for f in files if (m := _DP_RANK.search(f.name))}


def _check_files(ckpt: Path, files: list[Path], mp: int, dp: int, zero: bool) -> None:
    """Every file DeepSpeed writes for TP rank `mp` is there: the model states (one per DP rank under ZeRO-3,
    else one) and, with a ZeRO optimizer, one optimizer shard per DP rank."""
    model = [f for f in files if f.name.endswith("model_states.pt")]
    optim = [f for f in files if f.name.endswith("optim_states.pt")]
    if not model:
        raise CheckpointError(f"{ckpt} is partial: the model states of TP rank {mp} (mp_rank_{mp:02d}) are missing")
    # ZeRO-3 writes model states per DP rank too; a ZeRO optimizer (stage >= 1) one shard per DP rank
    for kind, found, per_dp in (("model states", model, bool(_dp_ranks(model))), ("ZeRO optimizer shard", optim, zero)):
        if per_dp:
            missing = sorted(set(range(dp)) - _dp_ranks(found))
            if missing:
                raise CheckpointError(f"{ckpt} is partial: the {kind} of DP rank {missing[0]}, TP rank {mp} is missing")


def _tp_rank_state(ckpt: Path, files: list[Path], mp: int) -> dict[str, torch.Tensor]:
    """One TP rank's fp32 weights from its model-state and ZeRO optimizer files."""
    for f in files:
        _load(f)  # name a damaged file here rather than deep inside DeepSpeed
    if not any(f.name.endswith("optim_states.pt") for f in files):  # ZeRO stage 0: the module weights
        return {k: v.float() for k, v in _load(files[0])["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory() as view:
        (Path(view) / "tag").mkdir()
        for f in files:
            (Path(view) / "tag" / f.name).symlink_to(f.resolve())
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(view, tag="tag")
        except (ValueError, FileNotFoundError) as e:
            raise CheckpointError(f"{ckpt} TP rank {mp}: {str(e).splitlines()[0]}") from None
    return {k: v.float() for k, v in state.items()}


def read_checkpoint(ckpt: Path, model: T5Model, tp: int, dp: int) -> dict[str, torch.Tensor]:
    """The full (TP=1) fp32 state dict of a checkpoint saved by TP x DP ranks, checked against `model`."""
    by_mp: dict[int, list[Path]] = {mp: [] for mp in range(tp)}
    for f in sorted(ckpt.glob("*mp_rank_*_states.pt")):
        by_mp.setdefault(int(_MP_RANK.search(f.name).group(1)), []).append(f)
    zero = any(f.name.endswith("optim_states.pt") for files in by_mp.values() for f in files)
    for mp in range(tp):
        _check_files(ckpt, by_mp[mp], mp, dp, zero)
    shards = [_tp_rank_state(ckpt, by_mp[mp], mp) for mp in range(tp)]
    full = {}
    for name, param in model.named_parameters():
        missing = [mp for mp in range(tp) if name not in shards[mp]]
        if missing:
            raise CheckpointError(f"{ckpt} lacks parameter {name} (TP rank {missing[0]}); is it from another model?")
        parts = [s[name] for s in shards]
        if tp == 1 or not getattr(param, "tensor_model_parallel", False):
            full[name] = parts[0]
            continue
        dim, stride = param.partition_dim, param.partition_stride
        # rank r holds sub-parameter pieces [s0 piece r; s1 piece r]: regroup as [s0 pieces..., s1 pieces...]
        pieces = [p.chunk(stride, dim=dim) for p in parts]
        full[name] = torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)
        if full[name].shape != param.shape:
            raise CheckpointError(f"{ckpt}: {name} gathers to {tuple(full[name].shape)}, the model has {tuple(param.shape)}")
    return full


# --------------------------------------------------------------------------------------------------------
# Our names <-> HuggingFace's T5 layout (Synthesizer parameters under the HF self-attention module)
# --------------------------------------------------------------------------------------------------------
def _vanilla(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, encoder_attention="vanilla", decoder_attention="vanilla")


def _qkv_free_stacks(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(s for s in ("encoder", "decoder") if "vanilla" not in parse_mixers(getattr(cfg, f"{s}_attention")))


def to_export_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict in HF T5 names (Synthesizer extras kept under the HF self-attention module)."""
    h, dkv, d = cfg.num_heads, cfg.d_kv, cfg.d_model
    common, extra = {}, {}
    for name, t in state.items():
        m = _LAYER.match(name)
        if m and m.group(3) not in ("qkv.weight", "o.weight", "v.weight"):
            extra[f"{m.group(1)}.block.{m.group(2)}.layer.0.SelfAttention.{m.group(3)}"] = t.clone()
        elif m and m.group(3) == "v.weight":
            # a layer without dot-product attention: give the converter zero Q/K rows, keep only V
            zeros = torch.zeros(h, 2, dkv, d, dtype=t.dtype)
            qkv = torch.cat([zeros, t.view(h, 1, dkv, d)], dim=1)  # rows [head, (q, k, v), d_kv]
            common[name.replace("v.weight", "qkv.weight")] = qkv.reshape(3 * h * dkv, d)
        else:
            common[name] = t
    hf = to_hf_state_dict(common, _vanilla(cfg))
    for stack in _qkv_free_stacks(cfg):
        for key in [k for k in hf if _HF_LAYER.match(k) and k.startswith(stack) and k.endswith(("q.weight", "k.weight"))]:
            del hf[key]
    return {**hf, **extra}


def from_export_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_export_state_dict`: HF T5 names back to our parameter names."""
    h, dkv, d = cfg.num_heads, cfg.d_kv, cfg.d_model
    common, extra = dict(hf), {}
    for name in list(common):
        m = _HF_LAYER.match(name)
        if m and m.group(3) not in ("q.weight", "k.weight", "v.weight", "o.weight", "relative_attention_bias.weight"):
            extra[f"{m.group(1)}.layers.{m.group(2)}.attn.{m.group(3)}"] = common.pop(name)
    qkv_free = _qkv_free_stacks(cfg)
    for name in [k for k in common if k.endswith("SelfAttention.v.weight") and k.startswith(qkv_free)]:
        for proj in ("q", "k"):
            common[name.replace(".v.weight", f".{proj}.weight")] = torch.zeros(h * dkv, d)
    ours = from_hf_state_dict(common, _vanilla(cfg))
    for name in [k for k in ours if k.endswith("attn.qkv.weight") and k.startswith(qkv_free)]:
        ours[name.replace("qkv.weight", "v.weight")] = ours.pop(name).view(h, 3, dkv, d)[:, 2].reshape(h * dkv, d)
    return {**ours, **extra}


# --------------------------------------------------------------------------------------------------------
# Writing and reading the export folder
# --------------------------------------------------------------------------------------------------------
def write_tokenizer(spiece: Path, out: Path) -> None:
    """spiece.model plus the files HF's T5 tokenizer expects (converted once here, not on every load)."""
    from transformers import T5Tokenizer

    shutil.copyfile(spiece, out / SPIECE)
    T5Tokenizer.from_pretrained(str(out), extra_ids=100).save_pretrained(str(out))


def write_export(model: T5Model, spiece: Path, output: Path, dtype: torch.dtype = torch.float32,
                 source: dict | None = None) -> Path:
    """Write `model` (TP=1) to `output` atomically: everything goes to output.tmp, renamed when complete."""
    if output.exists():
        raise ValueError(f"{output} already exists; remove it or choose another --output")
    cfg: ModelConfig = model.config
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.to(dtype).contiguous() for k, v in to_export_state_dict(full_state_dict(model), cfg).items()}
    save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    config = hf_config(cfg)
    vanilla = (cfg.encoder_attention, cfg.decoder_attention) == ("vanilla", "vanilla")
    config.architectures = ["T5ForConditionalGeneration" if vanilla else "SynthesizerT5"]
    config.synthesizer = {
        "model": dataclasses.asdict(cfg),
        "mixture_weights": {k: v.tolist() for k, v in model.mixture_weights().items()},  # softmax(mix)
        "source": source or {},
    }
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(str(tmp))
    write_tokenizer(spiece, tmp)
    tmp.rename(output)
    return output


def export(run_dir: str | Path, output: str | Path, step: int | None = None, dtype: str = "fp32") -> Path:
    """Checkpoint of `run_dir` (`latest` or step_N) -> the export folder `output`."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"--dtype '{dtype}' is not one of fp32, bf16")
    run_dir, output = Path(run_dir), Path(output)
    if output.exists():
        raise ValueError(f"{output} already exists; remove it or choose another --output")
    ckpt = find_checkpoint(run_dir, step)
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg = ModelConfig(**saved["model"])
    spiece = Path(saved["data"]["tokenizer"])
    if not spiece.is_file():
        raise ValueError(f"the run's tokenizer {spiece} (data.tokenizer in {ckpt / 'config.yaml'}) is missing")
    trainer = json.loads((ckpt / "trainer_state.json").read_text())
    model = build_local_model(cfg)
    load_full_state_dict(model, read_checkpoint(ckpt, model, trainer["tp"], trainer["dp"]))
    source = {"checkpoint": str(ckpt.resolve()), "step": trainer["step"], "tp": trainer["tp"], "dp": trainer["dp"]}
    log.info("exporting %s (step %d, TP %d x DP %d) to %s", ckpt, trainer["step"], trainer["tp"], trainer["dp"], output)
    return write_export(model, spiece, output, torch.float32 if dtype == "fp32" else torch.bfloat16, source)


def read_export(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full fp32 state dict in our names) of an export folder."""
    folder = Path(folder)
    for part in (CONFIG, WEIGHTS, SPIECE):
        if not (folder / part).is_file():
            raise ValueError(f"{folder} is not an export folder: {part} is missing (make one with python -m pretrain.export)")
    config = json.loads((folder / CONFIG).read_text())
    if "synthesizer" not in config:
        raise ValueError(f"{folder / CONFIG} has no 'synthesizer' section: not written by pretrain.export")
    cfg = ModelConfig(**config["synthesizer"]["model"])
    hf = {k: v.float() for k, v in load_file(str(folder / WEIGHTS)).items()}
    return cfg, from_export_state_dict(hf, cfg)


def load_pretrained(folder: str | Path) -> T5Model:
    """Our model (TP = 1, CPU, eval mode) from an export folder; `model(input_ids=..., attention_mask=...,
    decoder_input_ids=...)` returns an object with `.logits`."""
    cfg, state = read_export(folder)
    model = build_local_model(cfg)
    load_full_state_dict(model, state)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run folder (run.dir of the pretraining)")
    parser.add_argument("--output", required=True, help="export folder to create")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of the saved weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(export(args.run, args.output, args.step, args.dtype))
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
