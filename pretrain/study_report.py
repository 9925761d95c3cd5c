"""The study's report: results.csv (one row per cell), results.md (means +- standard deviation over seeds,
beside the paper's reported figures) and figures/*.png, all read back from the cells' own files
(cell.json, metrics.jsonl, the exports' safetensors). Written by `python -m pretrain.study`.
"""
from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from pretrain import figures
from pretrain.study import TEXT_ONLY, StudyConfig, cells, collect, read_metrics, slug

# Tay et al. 2021 (arXiv 2005.00743), T5-base-sized models pretrained on C4, as quoted by secondary summaries
# (../shared/reference/synthesizer.md; not checked against the paper itself): masked-LM log-perplexity (lower
# is better) and training steps/s. Our eval_loss is the same quantity (token cross-entropy of span
# corruption, nats), on other data at another scale, so only the ordering is comparable.
PAPER = {
    "vanilla": {"log_ppl": 1.865, "steps_per_s": 3.90},
    "random": {"log_ppl": 1.965, "steps_per_s": 4.26},
    "random+vanilla": {"log_ppl": 1.849},
}
PAPER_SOURCE = ("Tay et al., Synthesizer (arXiv 2005.00743), C4 pretraining at T5-base size, as reported in "
                "secondary summaries (see ../shared/reference/synthesizer.md)")
EXAMPLE = "the film is a charming and often affecting journey through a world of music ."


def _columns(rows: list[dict]) -> list[str]:
    first = ["variant", "encoder", "decoder", "seed", "status", "parameters", "tokens_per_s", "eval_loss", "eval_accuracy"]
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


def write_markdown(cfg: StudyConfig, rows: list[dict], path: Path) -> None:
    summary = summarise(rows)
    downstream = [k for k in _columns(rows) if "/" in k]
    vanilla_speed = summary.get("vanilla", {}).get("tokens_per_s")
    lines = [f"# Synthesizer study: {len(rows)} cells ({sum(r['status'] == 'ok' for r in rows)} finished)", "",
             f"Pretraining: `{cfg.pretrain.config}` {' '.join(cfg.pretrain.overrides)}; seeds {list(cfg.study.seeds)}; "
             f"tasks: {', '.join(t.name for t in cfg.study.tasks) or 'none'}. Mean ± standard deviation over the "
             "finished seeds (n); downstream scores as fractions.", ""]
    head = ["variant", "n", "parameters", "tokens/s", "vs vanilla", "eval loss", "eval token acc.", *downstream,
            "paper log-ppl", "paper steps/s vs vanilla"]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for variant, stats in summary.items():
        n = max((s[2] for s in stats.values()), default=0)
        speed = stats.get("tokens_per_s")
        ratio = f"{speed[0] / vanilla_speed[0]:.2f}" if speed and vanilla_speed else "-"
        paper = PAPER.get(variant, {})
        paper_ratio = (f"{paper['steps_per_s'] / PAPER['vanilla']['steps_per_s']:.2f}"
                       if "steps_per_s" in paper else "-")
        params = stats.get("parameters")
        cells_ = [variant, str(n), f"{params[0]:,.0f}" if params else "-", _fmt(speed, 0), ratio,
                  _fmt(stats.get("eval_loss"), 3), _fmt(stats.get("eval_accuracy"), 3),
                  *[_fmt(stats.get(k), 3) for k in downstream], str(paper.get("log_ppl", "-")), paper_ratio]
        lines.append("| " + " | ".join(cells_) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "Cells without results:", ""]
        lines += [f"- {r['variant']} seed {r['seed']}: {r['status']}" for r in failed]
    lines += ["", f"Paper figures: {PAPER_SOURCE}. Per-cell numbers: results.csv; figures: figures/.", ""]
    path.write_text("\n".join(lines))


def write_figures(cfg: StudyConfig, rows: list[dict], folder: Path) -> list[Path]:
    """Loss curves, downstream bars, mixture weights, learned random matrices, Dense vs vanilla attention."""
    from safetensors.torch import load_file

    written = []
    grid = cells(cfg)
    records = {c: read_metrics(c.dir / "pretrain") for c in grid}
    curves = {f"{c.variant.label} seed {c.seed}": [(r["step"], r["loss"]) for r in recs if "loss" in r]
              for c, recs in records.items() if recs}
    if curves:
        written.append(figures.plot_curves(curves, folder / "pretrain_loss.png", "step", "training loss",
                                           "Pretraining loss (span corruption)"))
    summary = summarise(rows)
    downstream = [k for k in _columns(rows) if "/" in k]
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
            written.append(figures.plot_mixture(mixture, folder / f"mixture_{slug(label)}.png",
                                                f"{label}, seed {c.seed}: mixture weights per layer"))
        matrices = figures.synthesizer_matrices(load_file(str(c.dir / "export" / "model.safetensors")))
        if matrices:
            written.append(figures.plot_heads(matrices, folder / f"matrices_{slug(label)}.png",
                                              f"{label}, seed {c.seed}: learned synthesizer logits per head"))
    dense = next((c for label, c in finished.items() if "dense" in c.variant.encoder.split("+")), None)
    vanilla = next((c for c in finished.values() if c.variant.encoder == "vanilla"), None)
    if dense and vanilla:
        written.append(attention_figure(dense, vanilla, folder / "attention_dense_vs_vanilla.png"))
    return written


def attention_figure(dense, vanilla, path: Path) -> Path:
    """Encoder layer 0, head 0 on one sentence: vanilla's dot-product attention beside Dense's synthesized one."""
    import torch

    from pretrain.export import load_pretrained
    from tokenizer.spm import Tokenizer

    tok = Tokenizer(dense.dir / "export" / "spiece.model")
    ids = tok.encode(EXAMPLE)
    pieces = [tok.sp.id_to_piece(i) if i < tok.sp.get_piece_size() else str(i) for i in ids]
    input_ids = torch.tensor([ids])
    maps = {f"vanilla (seed {vanilla.seed})": figures.attention_maps(load_pretrained(vanilla.dir / "export"), input_ids)["vanilla"]}
    dense_maps = figures.attention_maps(load_pretrained(dense.dir / "export"), input_ids)
    maps[f"{dense.variant.label}: dense part (seed {dense.seed})"] = dense_maps["dense"]
    if len(dense_maps) > 2:  # a mixture: also what the layer really uses
        maps[f"{dense.variant.label}: mixed"] = dense_maps["mixed"]
    return figures.plot_attention(maps, pieces, path, "Encoder layer 0, head 0: attention on one sentence")


def write_report(cfg: StudyConfig) -> Path:
    root = Path(cfg.study.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = collect(cfg)
    write_csv(rows, root / "results.csv")
    write_markdown(cfg, rows, root / "results.md")
    write_figures(cfg, rows, root / "figures")
    print((root / "results.md").read_text(), flush=True)
    return root / "results.md"
