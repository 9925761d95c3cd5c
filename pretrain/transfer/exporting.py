"""Export a training checkpoint to one folder that HuggingFace and our downstream jobs load, and load it back.

    python -m pretrain.export --run RUN_DIR --output OUT [--step N] [--dtype fp32|bf16] [--max-shard-size 5GB]

Input: `RUN_DIR/checkpoints/step_N/` (default: the newest complete one; an incomplete one, or a damaged one whose
files do not match their crc32 in complete.json, is refused naming the file) in
DeepSpeed's sharded layout at any TP, any ZeRO stage and any number of ranks. The files are memory-mapped and
each parameter is read on its own: at ZeRO 1/2 from every DP rank's flat fp32 partition (`param_slice_mappings`,
ds_to_universal's rule), at ZeRO 3 by DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)` (run
on a view holding only that TP rank's files, since the tool itself knows no TP), at ZeRO 0 from the module; its TP
shards are concatenated as megatron's attributes on the TP=1 model say (`partition_dim`, `partition_stride`), and
it is converted, cast and appended to the weights file (`pretrain.transfer.weights_writer`) before the next is read, so host
memory holds the weights about once (the mapped files' pages), not the model plus its HF layout. Every file is
unpickled with `weights_only=True`, DeepSpeed's own reads included: a checkpoint file that would run code is refused.

Output (written to OUT.tmp, renamed to OUT only when complete, removed on a failure such as a full disk): the weights in HuggingFace's T5 names as
`model.safetensors`, or above `--max-shard-size` as `model-0000k-of-0000n.safetensors` plus
`model.safetensors.index.json`; `config.json` (HF's config plus `synthesizer`: our model config, the learned
mixture weights, the source run and checkpoint by name, the crc32 of the weights and tokenizer files, which
`export_config` checks); `generation_config.json`; `README.md` (the model card); `spiece.model` (the tokenizer the
model was trained with: the checkpoint's copy, checked against the sha256 in its inputs.json), `tokenizer.json` and
`tokenizer_config.json` (T5Tokenizer/T5TokenizerFast load them). The HF files are written by
`pretrain.transfer.hf_files` so that transformers 4.57 and 5.x read them alike. Vanilla models are plain
HF T5 (model_type "t5"). A Synthesizer model is model_type "synthesizer_t5" with `auto_map` and the remote code
of `pretrain/model/hf_synthesizer/` (and AutoModel's class, `remote_code/`) copied in, so
`AutoModelForSeq2SeqLM.from_pretrained(OUT, trust_remote_code=True)` runs it (and without trust_remote_code
transformers refuses it); `AutoModel` gives the encoder-decoder without the LM head, as T5Model; its extra parameters
(`mix`, `synth.*`) sit under the HF self-attention module (`encoder.block.3.layer.0.SelfAttention.synth.random.r`)
and a layer without dot-product attention has no `q`, `k`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import yaml
from huggingface_hub import split_torch_state_dict_into_shards

from pretrain.core.config import ModelConfig, UsageError, saved_model_config
from pretrain.core.manifest import check_intact, complete_steps, describe, tag_for
from pretrain.core.progress import progress
from pretrain.model import T5Model, build_local_model, full_state_dict
from pretrain.model.hf_convert import Target, hf_config, hf_targets, vanilla_layout
from pretrain.model.hf_synthesizer.configuration_synthesizer_t5 import SynthesizerT5Config
from pretrain.model.pretrained import EXPORT_MARK, LAYER, SPIECE, export_config, load_weights, self_attention_hf_name
from pretrain.model.sharding import VOCAB_PARAMETERS
from pretrain.runtime.checkpoint import INPUTS, TOKENIZER, sha256_of
from pretrain.transfer.hf_files import write_config, write_generation_config, write_tokenizer
from pretrain.transfer.model_card import model_card
from pretrain.transfer.weights_writer import WeightsWriter

log = logging.getLogger(__name__)

CARD = "README.md"
MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default split (transformers 5's save_pretrained says 50GB: xxl in one file)
REMOTE_CODE_DIR = Path(__file__).parents[1] / "model" / "hf_synthesizer"
REMOTE_CODE = ("configuration_synthesizer_t5.py", "modeling_synthesizer_t5.py")
ENCODER_DECODER_CODE = Path(__file__).parent / "remote_code" / "modeling_synthesizer_t5_model.py"  # AutoModel's
_CREDENTIALS = re.compile(r"//[^/@\s]*@")  # user:password@ in a shard URL
_MP_RANK = re.compile(r"mp_rank_(\d+)_")
_DP_RANK = re.compile(r"zero_pp_rank_(\d+)_")
Reader = Callable[[], torch.Tensor]  # reads one tensor when called


class CheckpointError(UsageError):
    """A checkpoint that is missing, incomplete or damaged; the message names the missing part."""


# --------------------------------------------------------------------------------------------------------
# Reading a training checkpoint
# --------------------------------------------------------------------------------------------------------
def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """step_N, or the newest complete checkpoint; an incomplete one (no completion marker, a file missing or
    cut) or a damaged one (a file whose checksum does not match) is refused, naming the file."""
    root = run_dir / "checkpoints"
    complete = complete_steps(root)
    if step is None:
        if not complete:
            raise CheckpointError(f"{run_dir} has no complete checkpoint in {root}")
        step = complete[-1]
    path = root / tag_for(step)
    if not path.is_dir():
        available = ", ".join(tag_for(s) for s in complete) or "none"
        raise CheckpointError(f"checkpoint {path} not found; complete ones: {available}")
    try:
        check_intact(path)
    except UsageError as e:
        raise CheckpointError(str(e)) from None
    return path


@contextlib.contextmanager
def _weights_only():
    """Every torch.load inside, DeepSpeed's own included (it asks for weights_only=False), unpickles with
    weights_only=True: tensors, plain containers and DeepSpeed's bookkeeping classes below, nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    saved = {k: os.environ.pop(k, None) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _load(file: Path) -> dict:
    """A checkpoint file, memory-mapped (nothing is copied until used); a damaged or foreign file is named here
    rather than deep inside DeepSpeed."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds objects that are not tensors or DeepSpeed's bookkeeping, so it is "
                              f"not loaded ({str(e).splitlines()[0]})") from None
    except Exception as e:  # an overwritten file: torch raises various types
        raise CheckpointError(f"{file} is damaged ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def _flat_partitions_state(model_states: dict, optim_states: list[dict]) -> dict[str, Reader]:
    """fp32 master weights of ZeRO 1/2 (DeepSpeed's ZeRO optimizer, or BF16_Optimizer with bf16, whose files its
    zero_to_fp32 does not read). Each DP rank's optimizer file holds flat fp32 partitions and `param_slice_mappings`
    (name -> start and numel of the parameter's fragment in that partition); a parameter is its fragments in DP-rank
    order (ds_to_universal's rule). Frozen parameters have no master copy: the module's value is the one trained with."""
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
    for optim in optim_states:  # in DP-rank order
        sd = optim["optimizer_state_dict"]
        for flat, mapping in zip(sd["single_partition_of_fp32_groups"], sd["param_slice_mappings"]):
            for name, fragment in mapping.items():
                pieces[name].append(flat.narrow(0, fragment.start, fragment.numel))  # a view: nothing read yet

    def read(name: str) -> torch.Tensor:
        return torch.cat(pieces[name]).view(shapes[name])

    state = {k: partial(v.float) for k, v in model_states["module"].items() if k not in shapes}
    return {**state, **{name: partial(read, name) for name in shapes}}


def _tp_rank_state(ckpt: Path, files: list[Path], mp: int) -> dict[str, Reader]:
    """One TP rank's fp32 weights from its model-state and ZeRO optimizer files (loaded weights_only and
    memory-mapped), each read (copied out of the files) only when called."""
    with _weights_only():
        loaded = {f: _load(f) for f in files}
        model_files = [f for f in files if f.name.endswith("model_states.pt")]
        optim_files = sorted((f for f in files if f.name.endswith("optim_states.pt")),
                             key=lambda f: int(_DP_RANK.search(f.name).group(1)))
        if not optim_files:  # ZeRO stage 0: the module weights
            return {k: partial(v.float) for k, v in loaded[model_files[0]]["module"].items()}
        if "param_slice_mappings" in loaded[optim_files[0]]["optimizer_state_dict"]:  # ZeRO 1 and 2
            return _flat_partitions_state(loaded[model_files[0]], [loaded[f] for f in optim_files])
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with tempfile.TemporaryDirectory() as view:  # ZeRO 3: DeepSpeed's own reader, lazily
            (Path(view) / "tag").mkdir()
            for f in files:
                (Path(view) / "tag" / f.name).symlink_to(f.resolve())
            try:
                state = get_fp32_state_dict_from_zero_checkpoint(view, tag="tag", lazy_mode=True)
            except (ValueError, FileNotFoundError) as e:
                raise CheckpointError(f"{ckpt} TP rank {mp}: {str(e).splitlines()[0]}") from None

    def read(name: str) -> torch.Tensor:  # a GatheredTensor: put together from every DP rank's partition now
        return state[name].contiguous().float()

    return {name: partial(read, name) for name in state}


def read_checkpoint(ckpt: Path, model: T5Model, tp: int) -> dict[str, Reader]:
    """The full (TP=1) fp32 parameters of a checkpoint saved at TP `tp` (any DP), checked against `model` (TP 1,
    any device: only its names and shapes are read), each read when called: the files are memory-mapped, so host
    memory holds the parameter being read, not the model. The vocabulary parameters hold the token rows only, as
    `full_state_dict` gives them (the padding is the saving TP's layout)."""
    by_mp: dict[int, list[Path]] = {mp: [] for mp in range(tp)}
    for f in sorted(ckpt.glob("*mp_rank_*_states.pt")):
        by_mp.setdefault(int(_MP_RANK.search(f.name).group(1)), []).append(f)
    shards = [_tp_rank_state(ckpt, by_mp[mp], mp) for mp in range(tp)]
    params = dict(model.named_parameters())
    for name in params:
        missing = [mp for mp in range(tp) if name not in shards[mp]]
        if missing:
            raise CheckpointError(f"{ckpt} lacks parameter {name} (TP rank {missing[0]}); is it from another model?")

    def read(name: str) -> torch.Tensor:
        param, parts = params[name], [s[name]() for s in shards]
        if tp == 1 or not getattr(param, "tensor_model_parallel", False):
            full = parts[0]
        else:
            dim, stride = param.partition_dim, param.partition_stride
            # rank r holds sub-parameter pieces [s0 piece r; s1 piece r]: regroup as [s0 pieces..., s1 pieces...]
            pieces = [p.chunk(stride, dim=dim) for p in parts]
            full = torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)
        expected = param.shape  # `model` is TP 1: the full shape, the vocabulary ones with this TP's padding
        if name in VOCAB_PARAMETERS and full.shape[1:] == expected[1:] and len(full) >= model.config.vocab_size:
            full = full[: model.config.vocab_size]  # the token rows: the saving TP's padding dropped
            expected = full.shape
        if full.shape != expected:
            raise CheckpointError(f"{ckpt}: {name} gathers to {tuple(full.shape)}, the model has {tuple(expected)}")
        return full

    return {name: partial(read, name) for name in params}


# --------------------------------------------------------------------------------------------------------
# Our names <-> HuggingFace's T5 layout (Synthesizer parameters under the HF self-attention module)
# --------------------------------------------------------------------------------------------------------
def export_tensors(name: str, t: torch.Tensor, targets: dict[str, Target]) -> dict[str, torch.Tensor]:
    """One of our full parameters as the export's tensors (views where the layout allows): HF T5 names and layout
    (`targets`: `hf_targets` of the model's vanilla layout), the Synthesizer parameters under the HF self-attention
    module, and a layer without dot-product attention with its V alone (no q, k)."""
    m = LAYER.match(name)
    if m and m.group(3) not in ("qkv.weight", "o.weight"):
        return {self_attention_hf_name(name): t}
    names, split = targets[name]
    return dict(zip(names, split(t)))


# --------------------------------------------------------------------------------------------------------
# Writing and reading the export folder
# --------------------------------------------------------------------------------------------------------
def write_export(model: T5Model, spiece: Path, output: Path, dtype: torch.dtype = torch.float32,
                 source: dict | None = None, max_shard_size: int | str = MAX_SHARD_SIZE,
                 weights: dict[str, Reader] | None = None) -> Path:
    """Write `model` (TP=1) to `output` atomically: everything goes to output.tmp, renamed when complete; on any
    failure output.tmp is removed, and a write that finds no room (disk full, quota) is one line (UsageError).

    `source`: where the weights come from (checkpoint, step, tokens_seen, data, evaluation) for the model card.
    `weights`: our full parameters, each read when called (`read_checkpoint`), for a `model` on the meta device
    that holds only the mixture logits; default `model`'s own. One parameter at a time is converted and written.
    """
    if output.exists():
        raise UsageError(f"{output} already exists; remove it or choose another --output")
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if weights is None:
        weights = {name: partial(t.detach) for name, t in full_state_dict(model, clone=False).items()}
    try:
        _write_folder(model, weights, spiece, tmp, output.name, dtype, source, max_shard_size)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written export stays behind, whatever went wrong
        reason = _disk_full(e)
        if reason:
            raise UsageError(f"writing the export {output} failed ({reason}); is the disk full or over quota? "
                             "nothing was written: free space or choose another --output") from None
        raise
    tmp.rename(output)
    return output


def _disk_full(e: BaseException) -> str:
    """The reason, when `e` is a write that found no room (disk full, quota, a file size limit); else ""."""
    code = e.errno if isinstance(e, OSError) else None
    return os.strerror(code) if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""


def _write_weights(model: T5Model, weights: dict[str, Reader], tmp: Path, dtype: torch.dtype,
                   max_shard_size: int | str) -> list[Path]:
    """The weights files: the layout from the shapes alone (`model` may be on the meta device), then each
    parameter read, converted, cast and appended in turn, so host memory holds about one parameter."""
    targets = hf_targets(vanilla_layout(model.config))
    shapes = full_state_dict(model, clone=False)  # TP 1: views; the vocabulary ones cut to the token rows
    layout = {hf: part.to(dtype) for name, t in shapes.items()
              for hf, part in export_tensors(name, torch.empty_like(t, device="meta"), targets).items()}
    writer = WeightsWriter(tmp, layout, max_shard_size)
    for name in progress(shapes, desc="write weights"):
        for hf, part in export_tensors(name, weights[name](), targets).items():
            writer.write(hf, part.to(dtype))
    return writer.close()


def _write_folder(model: T5Model, weights: dict[str, Reader], spiece: Path, tmp: Path, output_name: str,
                  dtype: torch.dtype, source: dict | None, max_shard_size: int | str) -> None:
    """Every file of the export into `tmp` (write_export renames it when this returns)."""
    cfg: ModelConfig = model.config
    written = _write_weights(model, weights, tmp, dtype, max_shard_size)
    config = hf_config(cfg)
    mixture = {k: v.tolist() for k, v in model.mixture_weights().items()}  # softmax(mix)
    if isinstance(config, SynthesizerT5Config):
        # transformers' remote-code convention: the code travels with the weights, loaded only when asked
        for name in REMOTE_CODE:
            shutil.copyfile(REMOTE_CODE_DIR / name, tmp / name)
        shutil.copyfile(ENCODER_DECODER_CODE, tmp / ENCODER_DECODER_CODE.name)
        config.architectures = ["SynthesizerT5ForConditionalGeneration"]
        config.auto_map = {
            "AutoConfig": "configuration_synthesizer_t5.SynthesizerT5Config",
            "AutoModelForSeq2SeqLM": "modeling_synthesizer_t5.SynthesizerT5ForConditionalGeneration",
            "AutoModel": "modeling_synthesizer_t5_model.SynthesizerT5Model",  # no LM head, as T5Model
        }
    else:
        config.architectures = ["T5ForConditionalGeneration"]
    write_tokenizer(spiece, tmp, cfg.max_length)
    # sizes and crc32 of the weights and the tokenizer, checked by pretrained.export_config (fine-tuning, evaluation)
    files = describe(tmp, [*written, tmp / SPIECE])
    config.synthesizer = {"model": dataclasses.asdict(cfg), "mixture_weights": mixture, "source": source or {},
                          "files": files, "weights_mark": EXPORT_MARK}
    config.dtype = str(dtype).removeprefix("torch.")
    write_config(config, tmp)
    write_generation_config(tmp, cfg.max_length)
    num_params = sum(p.numel() for p in model.parameters())  # TP = 1: the full model
    (tmp / CARD).write_text(model_card(cfg, num_params, mixture, source or {}, output_name))


def _evaluation(run_dir: Path, step: int) -> dict[str, float]:
    """What the run measured up to `step`: the last eval_* scalars of metrics.jsonl and results.json's metrics."""
    found: dict[str, float] = {}
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill: the card just omits it
            continue
        if record.get("step", step + 1) <= step:
            found.update({k: v for k, v in record.items() if k.startswith("eval_")})
    results = run_dir / "results.json"
    if results.is_file():
        for task, scores in json.loads(results.read_text()).items():
            found.update({f"{task}/{metric}": value for metric, value in scores.items()})
    return found


def export(run_dir: str | Path, output: str | Path, step: int | None = None, dtype: str = "fp32",
           max_shard_size: int | str = MAX_SHARD_SIZE) -> Path:
    """Checkpoint of `run_dir` (the newest complete one, or step_N) -> the export folder `output`."""
    if dtype not in ("fp32", "bf16"):
        raise UsageError(f"--dtype '{dtype}' is not one of fp32, bf16")
    try:
        split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)  # checks the size's spelling
    except ValueError:
        raise UsageError(f"--max-shard-size '{max_shard_size}' is not a size such as 5GB or 500MB") from None
    run_dir, output = Path(run_dir), Path(output)
    if output.exists():
        raise UsageError(f"{output} already exists; remove it or choose another --output")
    if output.resolve().is_relative_to((run_dir / "checkpoints").resolve()):  # the trainer's: pruned, re-saved
        raise UsageError(f"--output {output} is inside {run_dir / 'checkpoints'}, whose folders the run's saves prune "
                         "and replace; choose a folder outside it")
    ckpt = find_checkpoint(run_dir, step)
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg = saved_model_config(saved["model"])
    spiece = _trained_tokenizer(ckpt, Path(saved["data"]["tokenizer"]))
    trainer = json.loads((ckpt / "trainer_state.json").read_text())
    log.info("exporting %s (step %d, TP %d x DP %d) to %s", ckpt, trainer["step"], trainer["tp"], trainer["dp"], output)
    model = build_local_model(cfg, device="meta")  # TP 1: names, shapes; nothing drawn at random
    weights = read_checkpoint(ckpt, model, trainer["tp"])
    # the mixture logits (a few numbers a layer), for the config's and the model card's mixture weights
    model.load_state_dict({k: weights[k]() for k in weights if k.endswith(".mix")}, strict=False, assign=True)
    source = {  # published with the export: names, never the training machine's absolute paths
        "run": run_dir.resolve().name, "checkpoint": str(ckpt.relative_to(run_dir)), "step": trainer["step"],
        "tokens_seen": trainer.get("tokens_seen"), "tp": trainer["tp"], "dp": trainer["dp"],
        "evaluation": _evaluation(run_dir, trainer["step"]),
        # pretraining shards (data.train), a corpus mixture (data.sources) or a fine-tuning task (task.name)
        "data": _published(str(saved.get("data", {}).get("train") or saved.get("task", {}).get("name", ""))),
    }
    if saved.get("data", {}).get("sources"):
        source["sources"] = _mixture(saved["data"]["sources"], ckpt)
        source["data"] = "mixture: " + ", ".join(f"{s['name']} {s['weight']:g} ({s['train']}" + (
            f", {s['shards']} shards)" if s["shards"] is not None else ")") for s in source["sources"])
    return write_export(model, spiece, output, torch.float32 if dtype == "fp32" else torch.bfloat16, source,
                        max_shard_size, weights)


def _mixture(sources: list[dict], ckpt: Path) -> list[dict]:
    """Each source of a mixture run: name, weight, its shards' location (published) and how many shards it read,
    from the checkpoint's data state (DP rank 0's `data_dp0.pt` records the mixture; None where it has none)."""
    state = ckpt / "data_dp0.pt"
    record = (torch.load(state, weights_only=True).get("sources") or []) if state.is_file() else []
    counts = {s["name"]: len(s["shards"]) for s in record if s.get("shards") is not None}  # None: saved before mixtures
    return [{"name": s["name"], "weight": s["weight"], "train": _published(s["train"]), "shards": counts.get(s["name"])}
            for s in sources]


def _published(location: str) -> str:
    """A data location fit for a public model card: a URL without credentials; an absolute local path without the
    machine's folders above its last two parts (`/scratch/alice/c4/shards` -> `c4/shards`)."""
    if "://" in location or location.startswith("pipe:"):
        return _CREDENTIALS.sub("//", location)
    return str(Path(*Path(location).parts[-2:])) if Path(location).is_absolute() else location


def _trained_tokenizer(ckpt: Path, configured: Path) -> Path:
    """The tokenizer the model was trained with: the checkpoint's own copy, or (a checkpoint without one)
    data.tokenizer of its config; refused when its sha256 is not the one in inputs.json."""
    spiece = ckpt / TOKENIZER if (ckpt / TOKENIZER).is_file() else configured
    if not spiece.is_file():
        raise UsageError(f"the run's tokenizer {spiece} (data.tokenizer in {ckpt / 'config.yaml'}) is missing")
    recorded = json.loads((ckpt / INPUTS).read_text())["tokenizer_sha256"] if (ckpt / INPUTS).is_file() else None
    if recorded is None:
        log.warning("%s records no tokenizer hash: shipping %s unchecked", ckpt, spiece)
    elif sha256_of(spiece) != recorded:
        raise UsageError(f"{spiece} is not the tokenizer the model was trained with (sha256 {recorded[:12]}... in "
                         f"{ckpt / INPUTS}); it was replaced since")
    return spiece


def load_pretrained(folder: str | Path) -> T5Model:
    """Our model (TP = 1, CPU, eval mode) from an export folder, or from one that HF's `save_pretrained` or
    Trainer saved from an export (tokenizer.json in place of spiece.model); `model(input_ids=...,
    attention_mask=..., decoder_input_ids=...)` returns an object with `.logits`."""
    model = build_local_model(export_config(folder), device="meta").to_empty(device="cpu")
    load_weights(model, folder, strict=True)  # one parameter at a time into the model's own memory
    return model.eval()
