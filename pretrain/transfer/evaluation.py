"""Evaluation of a text-to-text model on a task: greedy generation (cached) and rank classification over the
label words, the official metrics, `results.json`, a Markdown table, TensorBoard and submission files.

    python -m pretrain.evaluate --export OUT --task sst2 --data DIR --output RUN [--batch 32] [--device cuda]

Library use (any TP; every rank of a job calls together, each DP rank scores its slice): `predict`, then
`evaluate_task`, which scores the validation files, predicts the test files and returns
`{"sst2": {"accuracy": ..., "accuracy_rank": ...}}`. Metrics of greedy generation carry the plain names (T5's
protocol); those of rank classification end in `_rank`. Inputs go to the model's device. DP ranks run the same
number of forwards (ZeRO-3 gathers parameters in each): slices are padded to equal length and greedy decoding
stops on all ranks together. Inputs longer than a synthesized encoder's `model.max_length` are truncated.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from pretrain.core.config import ModelConfig, UsageError
from pretrain.core.files import write_atomic
from pretrain.core.finetune_config import METHODS, FinetuneConfig
from pretrain.core.progress import progress
from pretrain.model import T5Model, generate_greedy
from pretrain.model.generation import to_host
from pretrain.model.mixers import parse_mixers
from pretrain.runtime.faults import stop_if_preempted
from pretrain.tasks import Example, Task
from pretrain.tasks.baselines import baselines
from pretrain.tasks.metrics import COVERAGE, score
from pretrain.tasks.submission import write_submission
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Encoded:
    input_ids: torch.Tensor  # [b, n] padded with 0, EOS-terminated
    attention_mask: torch.Tensor  # [b, n]

    def to(self, device: torch.device) -> Encoded:
        return Encoded(self.input_ids.to(device), self.attention_mask.to(device))


def input_limit(model_cfg: ModelConfig, requested: int) -> int:
    """`requested` input length, capped at `model.max_length` when the encoder synthesizes attention (its N x N
    logits cannot cover longer inputs); the cap is logged once."""
    if set(parse_mixers(model_cfg.encoder_attention)) == {"vanilla"} or requested <= model_cfg.max_length:
        return requested
    _log_cap(requested, model_cfg.max_length)
    return model_cfg.max_length


@functools.cache
def _log_cap(requested: int, limit: int) -> None:
    log.info("inputs are truncated to %d tokens, the model.max_length of its synthesized encoder attention "
             "(%d requested)", limit, requested)


def encode_inputs(tokenizer: Tokenizer, texts: Sequence[str], max_length: int) -> Encoded:
    """Token ids + EOS, truncated to `max_length` (EOS kept), right-padded to the longest in the batch."""
    rows = [ids[: max_length - 1] + [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(texts))]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return Encoded(ids, (ids != tokenizer.pad_id).long())


def _to_class(task: Task, text: str) -> int | float:
    """A generated string as a prediction: a class id, -1 when it is none of the label words (T5's rule)."""
    text = text.strip()
    if task.regression:
        try:
            return float(text)
        except ValueError:
            return -1.0
    return task.label_words.index(text) if text in task.label_words else -1


@torch.no_grad()
def _generate(model: T5Model, tokenizer: Tokenizer, task: Task, batch: Encoded,
              group: dist.ProcessGroup | None) -> list:
    # room for the longest label word and its EOS: a longer answer is wrong whatever it says
    max_new = max(len(ids) for ids in tokenizer.encode_batch(list(task.label_words))) + 1
    ids = generate_greedy(model, batch.input_ids, batch.attention_mask, max_new, eos_id=tokenizer.eos_id,
                          use_cache=True, group=group)
    return [_to_class(task, tokenizer.decode(row.tolist())) for row in to_host(ids)]


@torch.no_grad()
def _rank(model: T5Model, tokenizer: Tokenizer, task: Task, batch: Encoded) -> list:
    """The label word with the highest log-likelihood (summed over its tokens and EOS) for each example."""
    words = [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(task.label_words))]
    k, width, b = len(words), max(len(w) for w in words), batch.input_ids.shape[0]
    labels = torch.zeros(k, width, dtype=torch.long)
    for i, w in enumerate(words):
        labels[i, : len(w)] = torch.tensor(w)
    labels = labels.to(batch.input_ids.device)
    valid = labels != tokenizer.pad_id  # [k, m]
    decoder_in = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)  # shift right, start 0
    memory = model.encode(batch.input_ids, batch.attention_mask)  # [b, n, d]
    # every example against every label word: [b * k] rows, the encoder run once per example
    memory = memory.repeat_interleave(k, dim=0)
    mask = batch.attention_mask.repeat_interleave(k, dim=0)
    logits = model.decode(decoder_in.repeat(b, 1), memory, mask)  # [b*k, m, V/tp]
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.repeat(b, 1))  # [b*k, m]
    scores = -(nll * valid.repeat(b, 1)).sum(dim=1).view(b, k)
    best = to_host(scores.argmax(dim=1)).tolist()
    return [float(task.label_words[i]) if task.regression else i for i in best]


def predict(model: T5Model, tokenizer: Tokenizer, task: Task, examples: Sequence[Example], method: str,
            batch_size: int, max_input_length: int, group: dist.ProcessGroup | None = None,
            between_batches: Callable[[], None] | None = None, desc: str = "") -> dict[str, list]:
    """{"generate": [...], "rank": [...]} predictions for this DP rank's examples (all of `examples` at DP 1).
    With `group`, its ranks (holding equally many examples) decode in lockstep. `between_batches` is called before
    each batch (a job's preemption check: it may raise). `desc` names the pass in the progress line (default: the
    task and method)."""
    if method not in METHODS:
        raise UsageError(f"eval method '{method}' is not one of {', '.join(METHODS)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_input_length = input_limit(model.config, max_input_length)
    out: dict[str, list] = {m: [] for m in ("generate", "rank") if method in (m, "both")}
    starts = range(0, len(examples), batch_size)
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    for start in progress(starts, len(starts), f"{desc or f'{task.name} {method}'}: batches", enabled=first_rank):
        if between_batches is not None:
            between_batches()
        texts = [e.inputs for e in examples[start : start + batch_size]]
        batch = encode_inputs(tokenizer, texts, max_input_length).to(device)
        if "generate" in out:
            out["generate"] += _generate(model, tokenizer, task, batch, group)
        if "rank" in out:
            out["rank"] += _rank(model, tokenizer, task, batch)
    model.train(was_training)
    return out


def _dp_slice(examples: Sequence[Example]) -> tuple[list[Example], int, int]:
    """(this DP rank's examples r, r + size, ..., padded with copies of the first example so that every rank holds
    ceil(n / size); how many are real; the DP size)."""
    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return list(examples), len(examples), 1
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = list(examples[rank::size])
    return mine + list(examples[:1]) * (-(-len(examples) // size) - len(mine)), len(mine), size


def _gather(preds: dict[str, list], size: int) -> dict[str, list]:
    """Predictions of every DP rank back in example order (rank r held examples r, r + size, ...)."""
    if size == 1:
        return preds
    parts: list = [None] * size
    dist.all_gather_object(parts, preds, group=parallel_state.get_data_parallel_group())
    merged = {}
    for method in preds:
        total = sum(len(p[method]) for p in parts)
        merged[method] = [parts[i % size][method][i // size] for i in range(total)]
    return merged


def check_evaluation_files(task: Task, folder: str | Path, submission: bool) -> None:
    """Read every validation file of `task` (and, with `submission`, its test files) now, before hours of training or
    a model's load: a wrong file is its TaskFileError, and a validation file without examples is refused, as its
    scores would be NaN (the mean of nothing)."""
    for split in task.splits:
        if not task.read(folder, split.validation, labelled=True):
            raise UsageError(f"task {task.name}: {Path(folder) / split.validation} holds no examples, so nothing "
                             "can be scored on it; give the task's validation file with its examples")
        if submission:
            task.read(folder, split.test, labelled=False)


def evaluate_task(model: T5Model, tokenizer: Tokenizer, task: Task, folder: str | Path, method: str = "both",
                  batch_size: int = 32, max_input_length: int = 512, limit: int = 0, submission_dir: Path | None = None,
                  between_batches: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """Scores on every validation file of `task` ({split name: metrics}); test predictions go to
    `submission_dir` when given (the first `limit` examples of each file when limit > 0). `between_batches`: see
    `predict` (every rank of a job runs as many batches)."""
    results = {}
    for split in task.splits:
        for file, labelled in ((split.validation, True), (split.test, False)):
            if not labelled and submission_dir is None:
                continue
            examples = task.read(folder, file, labelled)
            total, examples = len(examples), examples[:limit] if limit else examples
            if len(examples) < total:
                log.warning("%s: %d of the %d examples of %s (limit %d): %s", task.name, len(examples), total, file,
                            limit, "scores of those only, marked in results.json (examples, examples_in_file)"
                            if labelled else "a partial submission, named as such")
            mine, real, size = _dp_slice(examples)
            group = parallel_state.get_data_parallel_group() if size > 1 else None
            mine_preds = predict(model, tokenizer, task, mine, method, batch_size, max_input_length, group,
                                 between_batches, desc=f"{split.name} {file} {method}")  # sst2 dev.tsv both
            preds = _gather({m: p[:real] for m, p in mine_preds.items()}, size)
            if labelled:
                scores = {}
                for m, p in preds.items():
                    suffix = "" if m == "generate" else "_rank"
                    scores.update({f"{k}{suffix}": v for k, v in score(task, p, examples).items()})
                if undefined := [k for k, v in scores.items() if v != v]:  # NaN: a correlation of a constant series
                    log.warning("%s: %s undefined (NaN): the predictions or the labels are constant, and a "
                                "correlation needs both to vary", split.name, ", ".join(undefined))
                results[split.name] = {**scores, COVERAGE[0]: len(examples), COVERAGE[1]: total}
            elif not dist.is_initialized() or dist.get_rank() == 0:
                best = preds.get("generate") or preds["rank"]
                write_submission(task, split, examples, best, submission_dir, total)
    return results


def _percent(value: float) -> str:
    return "undefined" if value != value else f"{100 * value:.2f}"


def _row_name(name: str, scores: dict[str, float]) -> str:
    """The task, and how many of its file's examples its scores are of where that is not all."""
    scored, total = scores.get(COVERAGE[0]), scores.get(COVERAGE[1])
    return f"{name} ({scored} of {total} examples)" if scored is not None and scored != total else name


def task_baselines(task: Task, folder: str | Path, limit: int = 0) -> dict[str, dict[str, dict[str, float]]]:
    """{split: {"majority class (positive)": {metric: score}, ...}} on the validation examples `evaluate_task`
    scores (pretrain/tasks/baselines.py)."""
    out = {}
    for split in task.splits:
        examples = task.read(folder, split.validation, labelled=True)
        out[split.name] = baselines(task, examples[:limit] if limit else examples)
    return out


def markdown_table(results: dict[str, dict[str, float]], baselines: dict | None = None) -> str:
    """One row per task, one column per metric (as percentages, like the GLUE leaderboard), each followed by its
    baselines' rows ({split: {row: {metric: score}}}: a metric's score fills its `_rank` column too)."""
    columns = sorted({m for scores in results.values() for m in scores if m not in COVERAGE})
    lines = ["| task | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, scores in results.items():
        cells = [_percent(scores[c]) if c in scores else "" for c in columns]
        lines.append(f"| {_row_name(name, scores)} | " + " | ".join(cells) + " |")
        for row, base in (baselines or {}).get(name, {}).items():
            cells = [f"{100 * base[m]:.2f}" if (m := c.removesuffix("_rank")) in base else "" for c in columns]
            lines.append(f"| {name}: {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(run_dir: Path, results: dict[str, dict[str, float]], baselines: dict | None = None) -> None:
    """Merge into `run_dir/results.json` (other tasks' results are kept) and `baselines.json` (`task_baselines`),
    and rewrite `results.md` from both."""
    merged = {}
    for name, new in (("results.json", results), ("baselines.json", baselines or {})):
        path = run_dir / name
        merged[name] = json.loads(path.read_text()) if path.is_file() else {}
        merged[name].update(new)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(merged[name], indent=1, sort_keys=True) + "\n")
    (run_dir / "results.md").write_text(markdown_table(merged["results.json"], merged["baselines.json"]))


class TaskEvaluation:
    """Fine-tuning's evaluation (pretrain.runtime.loop's Evaluator): the task's official metrics on its validation
    files every `eval.every` steps and at the end (then also the test-set predictions); writes `results.json` /
    `results.md` (rank 0) and returns `eval/<split>/<metric>`."""

    def __init__(self, model: T5Model, tokenizer: Tokenizer, task: Task, cfg: FinetuneConfig, max_input_length: int,
                 run_dir: Path, rank: int) -> None:
        self.model, self.tokenizer, self.task, self.cfg = model, tokenizer, task, cfg
        self.max_input_length, self.run_dir, self.rank = max_input_length, run_dir, rank

    def due(self, step: int, final: bool) -> bool:
        return final or bool(self.cfg.eval.every and step % self.cfg.eval.every == 0)

    def __call__(self, step: int, final: bool) -> dict[str, float]:
        submission = self.run_dir / "submission" if final and self.cfg.eval.submission else None
        device = next(self.model.parameters()).device
        results = evaluate_task(self.model, self.tokenizer, self.task, self.cfg.data.dir, self.cfg.eval.method,
                                self.cfg.eval.batch, self.max_input_length, self.cfg.eval.limit, submission,
                                between_batches=lambda: stop_if_preempted(device, "during evaluation"))
        record = {f"eval/{split}/{k}": v for split, scores in results.items() for k, v in scores.items()}
        if self.rank == 0:
            write_results(self.run_dir, results, task_baselines(self.task, self.cfg.data.dir, self.cfg.eval.limit))
            log.info("step %d  %s", step, "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in record.items()))  # counts as counts
        return record
