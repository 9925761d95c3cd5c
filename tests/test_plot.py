"""`python -m pretrain.plot`: metrics.jsonl written by the real MetricsLogger -> one PNG with a panel per
metric and a line per run; a folder without metrics.jsonl or an unknown metric is a one-line error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image

from pretrain.plot import main, read_runs
from pretrain.runtime.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[1]


def _run(folder: Path, losses: list[float], evals: bool) -> Path:
    logger = MetricsLogger(folder, enabled=True)
    for i, loss in enumerate(losses, start=1):
        record = {"loss": loss, **({"eval_loss": loss + 0.5} if evals and i % 2 == 0 else {})}
        logger.write(10 * i, record, tokens_seen=640 * i)
    logger.close()
    return folder


def test_plot_runs_to_png(tmp_path: Path, capsys) -> None:
    a = _run(tmp_path / "a" / "pretrain", [4.0, 3.0, 2.5, 2.2], evals=True)
    b = _run(tmp_path / "b" / "pretrain", [4.2, 3.5, 3.0, 2.8], evals=False)
    runs = read_runs([str(a), str(b)])  # same folder names: labelled by path
    assert list(runs) == [str(a), str(b)]
    assert [r["loss"] for r in runs[str(a)]] == [4.0, 3.0, 2.5, 2.2]
    out = tmp_path / "curves.png"
    main([str(a), str(b), "--output", str(out), "--x", "tokens_seen"])
    assert capsys.readouterr().out.strip() == str(out)
    image = matplotlib.image.imread(out)
    # two panels (loss, eval_loss; no run has eval_accuracy) of 2.8 inches at 90 dpi, stacked
    assert image.shape[:2] == (2 * 252, 630)


def test_plot_errors_are_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", [3.0, 2.0], evals=False)
    for args, message in ((["nowhere"], "nowhere/metrics.jsonl not found"),
                          ([str(run), "--metrics", "los"], "no run has metric 'los'; available: loss, tokens_seen")):
        done = subprocess.run([sys.executable, "-m", "pretrain.plot", *args, "--output", str(tmp_path / "x.png")],
                              cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "x.png").exists()


def test_the_figure_is_titled_with_its_metrics_axis_and_runs(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.figure

    titles = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: titles.append(self.get_suptitle()) or save(self, *a, **k))
    a = _run(tmp_path / "small" / "pretrain", [4.0, 3.0, 2.5, 2.2], evals=True)
    assert main([str(a), "--output", str(tmp_path / "plot.png"), "--x", "tokens_seen"]) in (0, None)
    assert titles == ["loss, eval_loss against tokens_seen: pretrain"]  # the metrics it has, the run by its folder
