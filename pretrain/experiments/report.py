"""The study's report: results.csv (one row per cell), results.md (means +- standard deviation over seeds beside
the paper's reported figures and the baseline rows; paired differences to vanilla with 95% intervals; the
verdict on each of the paper's claims, computed by `pretrain.experiments.stats`) and figures/*.png, all read back
from the cells' own files (cell.json, metrics.jsonl, the exports) and study.dir/baseline.json.
Written by `python -m pretrain.study`.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from pretrain.experiments import figures
from pretrain.experiments.grid import TEXT_ONLY, StudyConfig, cells, collect, read_metrics, slug
from pretrain.experiments.movement import movement
from pretrain.experiments.stats import (
    CONFIDENCE,
    DECIDED_HALF_WIDTH,
    Interval,
    Verdict,
    find_variant,
    paired,
    per_seed,
    ratio,
    t_interval,
    task_keys,
    verdicts,
)
from pretrain.runtime import pictures

# Tay et al., "Synthesizer: Rethinking Self-Attention in Transformer Models" (ICML 2021), T5-base-sized models
# pretrained on C4, as quoted by secondary summaries of that revision (not checked against the paper itself):
# masked-LM log-perplexity (lower is better) and training steps/s. Our eval_loss is the same quantity (token
# cross-entropy of span corruption, nats), on other data at another scale, so only the ordering is comparable.
PAPER = {
    "vanilla": {"log_ppl": 1.865, "steps_per_s": 3.90},
    "random": {"log_ppl": 1.965, "steps_per_s": 4.26},
    "random+vanilla": {"log_ppl": 1.849},
}
# Narang et al., "Do Transformer Modifications Transfer Across Implementations and Applications?" (EMNLP 2021),
# Table 1: the Synthesizer paper's Mesh TensorFlow code, a 223M-parameter T5-style model, 524,288 steps on C4;
# final log-perplexity, SuperGLUE average and training steps/s at length 512 (the mixtures: learned weights)
NARANG = {
    "vanilla": {"log_ppl": 1.838, "superglue": 71.66, "steps_per_s": 3.50},
    "dense": {"log_ppl": 1.962, "superglue": 61.03},
    "random": {"log_ppl": 2.009, "superglue": 54.27, "steps_per_s": 4.08},
    "dense+vanilla": {"log_ppl": 1.828, "superglue": 74.25, "steps_per_s": 3.01},
    "random+vanilla": {"log_ppl": 1.828, "superglue": 75.24, "steps_per_s": 3.42},
}
PAPER_SOURCE = ("Tay et al., \"Synthesizer: Rethinking Self-Attention in Transformer Models\" (ICML 2021), its C4 "
                "pretraining figures at T5-base size as quoted by secondary summaries (not checked against the paper); "
                "Narang et al., \"Do Transformer Modifications Transfer Across Implementations and Applications?\" "
                "(EMNLP 2021), Table 1: the same Mesh TensorFlow code, a 223M-parameter T5-style model, 524,288 steps on "
                "C4 (log-perplexity, SuperGLUE average, steps/s at length 512)")
EXAMPLE = "the film is a charming and often affecting journey through a world of music ."


def _columns(rows: list[dict]) -> list[str]:
    first = ["variant", "encoder", "decoder", "settings", "seed", "status", "parameters", "tokens_per_s", "eval_loss",
             "eval_accuracy"]
    rest = [k for row in rows for k in row if k not in first]
    return first + list(dict.fromkeys(rest))


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows), restval="")
        writer.writeheader()
        writer.writerows(rows)


def summarise(rows: list[dict]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """{variant: {column: (mean, std over seeds, n)}} over the finished cells (std 0 for one seed)."""
    out: dict[str, dict[str, tuple[float, float, int]]] = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        done = [r for r in rows if r["variant"] == variant and r["status"] == "ok"]
        stats = {}
        for key in (k for k in _columns(done) if k not in TEXT_ONLY and k != "seed"):
            values = [float(r[key]) for r in done if key in r and not math.isnan(float(r[key]))]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                stats[key] = (statistics.fmean(values), std, len(values))
        out[variant] = stats
    return out


def _fmt(stat: tuple[float, float, int] | None, digits: int) -> str:
    if stat is None:
        return "-"
    mean, std, n = stat
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{mean:.{digits}f}"


def read_baseline(root: Path) -> dict | None:
    """study.dir/baseline.json (the unigram model of the validation targets), or None before the data stage."""
    path = root / "baseline.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|", *("| " + " | ".join(r) + " |" for r in body)]


def differences(rows: list[dict]) -> dict[str, dict[str, Interval]]:
    """{variant: {metric: paired interval vs vanilla}} for eval loss / accuracy, every task metric (differences)
    and tokens/s (the ratio, key "tokens_per_s"), for the variants with a seed paired with vanilla's; {} without
    a vanilla variant."""
    base = find_variant(rows, "vanilla")
    if base is None:
        return {}
    metrics = ["eval_loss", "eval_accuracy", *task_keys(rows)]
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        if variant != base:
            out[variant] = {m: paired(rows, variant, base, m) for m in metrics}
            out[variant]["tokens_per_s"] = paired(rows, variant, base, "tokens_per_s", op=ratio)
    return {v: d for v, d in out.items() if any(iv.n for iv in d.values())}


def pretraining_value(rows: list[dict]) -> dict[str, dict[str, Interval]]:
    """{variant: {TASK/METRIC: interval of pretrained - from random initialisation}} where scratch rows exist."""
    keys = [k for k in task_keys(rows) if any(f"scratch/{k}" in r for r in rows)]
    variants = dict.fromkeys(r["variant"] for r in rows)
    value = {v: {k: paired(rows, v, v, k, f"scratch/{k}") for k in keys} for v in variants}
    return {v: d for v, d in value.items() if any(iv.n for iv in d.values())}


def write_markdown(cfg: StudyConfig, rows: list[dict], path: Path, baseline: dict | None = None) -> None:
    summary = summarise(rows)
    downstream = task_keys(rows)
    vanilla_speed = summary.get("vanilla", {}).get("tokens_per_s")
    lines = [f"# Synthesizer study: {len(rows)} cells ({sum(r['status'] == 'ok' for r in rows)} finished)", "",
             f"Pretraining: `{cfg.pretrain.config}` {' '.join(cfg.pretrain.overrides)}; seeds {list(cfg.study.seeds)}; "
             f"tasks: {', '.join(t.name for t in cfg.study.tasks) or 'none'}. Mean ± standard deviation over the "
             "finished seeds (n); downstream scores as fractions.", ""]
    head = ["variant", "n", "parameters", "tokens/s", "vs vanilla", "eval loss", "eval token acc.", *downstream,
            "Tay log-ppl", "Tay steps/s vs vanilla", "Narang log-ppl", "Narang SuperGLUE", "Narang steps/s vs vanilla"]
    body, scratch = [], []
    for variant, stats in summary.items():
        n = max((s[2] for s in stats.values()), default=0)
        speed = stats.get("tokens_per_s")
        ratio_ = f"{speed[0] / vanilla_speed[0]:.2f}" if speed and vanilla_speed else "-"
        tay, narang = _published(PAPER, variant), _published(NARANG, variant)  # Tay's table has no SuperGLUE
        params = stats.get("parameters")
        body.append([variant, str(n), f"{params[0]:,.0f}" if params else "-", _fmt(speed, 0), ratio_,
                     _fmt(stats.get("eval_loss"), 3), _fmt(stats.get("eval_accuracy"), 3),
                     *[_fmt(stats.get(k), 3) for k in downstream], tay[0], tay[2], *narang])
        if any(f"scratch/{k}" in stats for k in downstream):
            counts = [stats[f"scratch/{k}"][2] for k in downstream if f"scratch/{k}" in stats]
            scratch.append([f"{variant}, from random init", str(max(counts)), "-", "-", "-", "-", "-",
                            *[_fmt(stats.get(f"scratch/{k}"), 3) for k in downstream], *["-"] * 5])
    if baseline:
        body.append(["unigram (baseline)", "-", "-", "-", "-", f"{baseline['unigram_loss']:.3f}",
                     f"{baseline['unigram_accuracy']:.3f}", *["-"] * (len(downstream) + 5)])
    lines += _table(head, body + scratch)
    if baseline:
        lines += ["", f"unigram: the best unigram model of the validation targets ({baseline.get('tokens', '?')} "
                  f"tokens; {baseline.get('source', '')})."]
    if scratch:
        lines += ["", "\"from random init\": the same model and seed fine-tuned without pretraining."]
    lines += _difference_sections(rows, baseline)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "Cells without results:", ""]
        lines += [f"- {r['variant']} seed {r['seed']}: {r['status']}" for r in failed]
    lines += ["", f"Paper figures: {PAPER_SOURCE}. Per-cell numbers: results.csv; figures: figures/.", ""]
    path.write_text("\n".join(lines))


def _published(source: dict, variant: str) -> list[str]:
    """A variant's cells from one publication: log-perplexity, SuperGLUE average, steps/s as a ratio to vanilla's."""
    figures = source.get(variant, {})
    speed = figures.get("steps_per_s")
    return [str(figures.get("log_ppl", "-")), str(figures.get("superglue", "-")),
            f"{speed / source['vanilla']['steps_per_s']:.2f}" if speed else "-"]


def _difference_sections(rows: list[dict], baseline: dict | None) -> list[str]:
    """The paired differences, pretrained-minus-scratch, the learned weights' movement and the verdicts."""
    lines = []
    diffs = differences(rows)
    level = f"{CONFIDENCE:.0%}"
    if diffs:
        metrics = ["eval_loss", "eval_accuracy", *task_keys(rows)]
        lines += ["", "## Paired differences to vanilla", "",
                  f"Per variant and metric: the mean over seeds of (seed s of the variant - seed s of vanilla) "
                  f"with its {level} t-interval [lo, hi] (n: seeds where both finished; n=1: no interval); "
                  "tokens/s as the mean paired ratio variant / vanilla.", ""]
        body = [[v, str(max(iv.n for iv in d.values())), *[d[m].text() for m in metrics], d["tokens_per_s"].text(2)]
                for v, d in diffs.items()]
        lines += _table(["variant", "n", "eval loss", "eval token acc.", *task_keys(rows), "tokens/s ratio"], body)
    value = pretraining_value(rows)
    if value:
        keys = list(next(iter(value.values())))
        lines += ["", "## Pretrained minus from random initialisation", "",
                  f"Per variant: the mean paired difference (pretrained - fine-tuned from random initialisation, same "
                  f"seed) with its {level} t-interval.", ""]
        lines += _table(["variant", *keys], [[v, *[d[k].text() for k in keys]] for v, d in value.items()])
    moved = {v: [_moved_text(rows, v, f"moved/{k}") for k in ("random", "mixture")]
             for v in dict.fromkeys(r["variant"] for r in rows)}
    moved = {v: texts for v, texts in moved.items() if any(texts)}
    if moved:
        lines += ["", "## How far the learned weights moved", "",
                  f"Mean over seeds with its {level} t-interval: the Random matrices' relative Frobenius change from "
                  "their initialisation, and the mixture weights' total-variation distance from uniform.", ""]
        lines += _table(["variant", "Random matrices: relative change", "mixture weights: distance from uniform"],
                        [[v, *(t or "-" for t in texts)] for v, texts in moved.items()])
    found = verdicts(rows, baseline)
    if found:
        lines += ["", "## Verdicts", "",
                  f"Computed from the {level} intervals by the rules of docs/study.md (\"Output\"): supports / "
                  "contradicts / cannot tell at this size.", ""]
        lines += _table(["question", "claim", "verdict", "evidence"],
                        [[v.question, v.claim, f"**{v.verdict}**", v.evidence] for v in found])
        lines += _decided([v for v in found if v.question.startswith("Q1")])
    return lines


def _decided(q1: list[Verdict]) -> list[str]:
    """Whether the pretraining questions have answers at the resolution asked of them (stats.Verdict.decided)."""
    if not q1:
        return []
    rule = (f"supports or contradicts, or cannot tell with a {CONFIDENCE:.0%} interval no wider than "
            f"±{DECIDED_HALF_WIDTH} nats")
    open_ = [v.claim for v in q1 if not v.decided]
    if not open_:
        return ["", f"**Q1 decided**: every pretraining verdict is {rule}."]
    return ["", f"**Q1 not decided**: {'; '.join(open_)}: cannot tell with an interval wider than "
            f"±{DECIDED_HALF_WIDTH} nats (more seeds, or more steps, narrow it)."]


def _moved_text(rows: list[dict], variant: str, key: str) -> str:
    values = per_seed(rows, variant, key)
    return t_interval(list(values.values())).text(3) if values else ""


def write_figures(cfg: StudyConfig, rows: list[dict], folder: Path) -> list[Path]:
    """Loss curves, paired differences, downstream bars, mixture weights, learned random matrices (with how far
    they moved), Dense vs vanilla attention."""
    from safetensors.torch import load_file

    written = []
    grid = cells(cfg)
    records = {c: read_metrics(c.dir / "pretrain") for c in grid}
    curves = {f"{c.variant.label} seed {c.seed}": [(r["step"], r["loss"]) for r in recs if "loss" in r]
              for c, recs in records.items() if recs}
    if curves:
        written.append(figures.plot_curves(curves, folder / "pretrain_loss.png", "step", "training loss",
                                           "Pretraining loss (span corruption)"))
    diffs = differences(rows)
    if diffs:
        names = {"eval_loss": "eval loss difference", "eval_accuracy": "eval token acc. difference",
                 "tokens_per_s": "tokens/s ratio"}
        panels = {names.get(m, f"{m} difference"): {v: (d[m].mean, d[m].lo, d[m].hi) for v, d in diffs.items()}
                  for m in next(iter(diffs.values()))}
        refs = {p: 1.0 if p == "tokens/s ratio" else 0.0 for p in panels}
        written.append(figures.plot_intervals(panels, refs, folder / "differences.png",
                                              f"Paired difference to vanilla, mean and {CONFIDENCE:.0%} t-interval over seeds"))
    summary = summarise(rows)
    downstream = task_keys(rows)
    if downstream and any(r["status"] == "ok" for r in rows):
        means = {v: {k: s[k][0] for k in downstream if k in s} for v, s in summary.items() if s}
        stds = {v: {k: s[k][1] for k in downstream if k in s} for v, s in summary.items() if s}
        written.append(figures.plot_bars(means, stds, folder / "downstream.png", "Fine-tuned scores (mean ± std over seeds)"))
    finished = {}  # variant label -> its first finished cell
    for c in grid:
        if (c.dir / "cell.json").is_file():
            finished.setdefault(c.variant.label, c)
    for label, c in finished.items():
        mixture: dict[str, dict[str, list]] = {}
        for r in records[c]:
            for key, w in r.items():
                if key.startswith("mixture/"):
                    _, layer, mixer = key.split("/")
                    mixture.setdefault(layer, {}).setdefault(mixer, []).append((r["step"], w))
        if mixture:
            moved = _moved_text(rows, label, "moved/mixture")
            written.append(figures.plot_mixture(mixture, folder / f"mixture_{slug(label)}.png",
                                                f"{label}, seed {c.seed}: mixture weights per layer\nend: {moved} from "
                                                f"uniform (TV; mean [{CONFIDENCE:.0%}] over seeds)"))
        matrices = pictures.synthesizer_matrices(load_file(str(c.dir / "export" / "model.safetensors")))
        if matrices:
            moved = _moved_text(rows, label, "moved/random")
            written.append(figures.plot_heads(matrices, folder / f"matrices_{slug(label)}.png",
                                              f"{label}, seed {c.seed}: learned synthesizer logits per head at the end\n"
                                              f"moved {moved} of their initial norm (mean [{CONFIDENCE:.0%}] over seeds)"))
    dense = next((c for label, c in finished.items() if "dense" in c.variant.encoder.split("+")), None)
    vanilla = next((c for c in finished.values() if c.variant.encoder == "vanilla"), None)
    if dense and vanilla:
        written.append(attention_figure(dense, vanilla, folder / "attention_dense_vs_vanilla.png"))
    return written


def attention_figure(dense, vanilla, path: Path) -> Path:
    """Encoder layer 0, head 0 on one sentence: vanilla's dot-product attention beside Dense's synthesized one."""
    import torch

    from pretrain.transfer.exporting import load_pretrained
    from tokenizer.spm import Tokenizer

    tok = Tokenizer(dense.dir / "export" / "spiece.model")
    ids = tok.encode(EXAMPLE)
    pieces = [tok.sp.id_to_piece(i) if i < tok.sp.get_piece_size() else str(i) for i in ids]
    input_ids = torch.tensor([ids])
    maps = {f"vanilla (seed {vanilla.seed})": pictures.attention_maps(load_pretrained(vanilla.dir / "export"), input_ids)["vanilla"]}
    dense_maps = pictures.attention_maps(load_pretrained(dense.dir / "export"), input_ids)
    maps[f"{dense.variant.label}: dense part (seed {dense.seed})"] = dense_maps["dense"]
    if len(dense_maps) > 2:  # a mixture: also what the layer really uses
        maps[f"{dense.variant.label}: mixed"] = dense_maps["mixed"]
    return figures.plot_attention(maps, pieces, path, "Encoder layer 0, head 0: attention on one sentence")


def write_report(cfg: StudyConfig) -> Path:
    root = Path(cfg.study.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = collect(cfg)
    for row, cell in zip(rows, cells(cfg)):  # collect's order: one row per cell
        if row["status"] == "ok":
            row.update(movement(cell.dir / "export", cell.seed))
    write_csv(rows, root / "results.csv")
    write_markdown(cfg, rows, root / "results.md", read_baseline(root))
    write_figures(cfg, rows, root / "figures")
    print((root / "results.md").read_text(), flush=True)
    return root / "results.md"
