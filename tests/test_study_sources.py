"""The study report's published figures (pretrain/experiments/report.py): Tay et al.'s and Narang et al.'s beside each
variant, and the sources named by title and table, never by a path outside the repository."""
from __future__ import annotations

from pathlib import Path

from pretrain.experiments.grid import StudyConfig
from pretrain.experiments.report import write_markdown
from tests.test_study_stats import hand_rows


def _cells(md: str, variant: str) -> dict[str, str]:
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split(" | ")]
    row = next(line for line in lines if line.startswith(f"| {variant} |"))
    return dict(zip(head, (c.strip() for c in row.strip("|").split(" | "))))


def test_report_cites_the_papers_figures_by_title(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    write_markdown(StudyConfig(), hand_rows(), path)
    md = path.read_text()
    # Narang et al. 2021, Table 1: log-perplexity, SuperGLUE, steps/s at length 512 (vanilla 3.50, Random 4.08,
    # Random+Vanilla 3.42); Tay et al. as quoted: 1.865 / 3.90 steps/s, Random 1.965 / 4.26, Random+Vanilla 1.849
    published = ["Tay log-ppl", "Tay steps/s vs vanilla", "Narang log-ppl", "Narang SuperGLUE",
                 "Narang steps/s vs vanilla"]
    expected = {"vanilla": ["1.865", "1.00", "1.838", "71.66", "1.00"],
                "random": ["1.965", "1.09", "2.009", "54.27", "1.17"],
                "random+vanilla": ["1.849", "-", "1.828", "75.24", "0.98"]}
    for variant, cells in expected.items():
        assert [_cells(md, variant)[c] for c in published] == cells, variant
    footer = md.strip().splitlines()[-1]
    assert "Do Transformer Modifications Transfer Across Implementations and Applications?" in footer
    assert "Table 1" in footer and "Synthesizer: Rethinking Self-Attention in Transformer Models" in footer
    assert "../" not in md and "shared/reference" not in md
