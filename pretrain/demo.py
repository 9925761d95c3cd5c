"""The main job, `make demo`: the whole chain on real text, on the CPU, in minutes.

    python -m pretrain.demo [--work runs/demo] [--pretrain-steps 400]

Stages, each the project's own command in a subprocess (so the demo runs exactly what a user runs), its whole
output in WORK/logs/stageN.log under the number of its header:
  1. text       real English text written in C4's json.gz layout     python -m pretrain.data.fetch
  2. tokenizer  a 1000-piece SentencePiece model + 100 sentinels      python -m tokenizer.train
  3. shards     webdataset shards of token ids: train                 python -m pretrain.data.prepare
  4. shards     the same: validation                                  python -m pretrain.data.prepare
  5. pretrain   the tiny Random+Vanilla Synthesizer, 2 processes (DP) launch.run -m pretrain.train
  6. export     checkpoint -> HF-layout folder                        python -m pretrain.export
  7. polarity   Pang & Lee's sentences in SST-2's layout              python -m pretrain.tasks.polarity
  8. finetune   text-to-text fine-tuning + evaluation at TP 2         launch.run -m pretrain.finetune
Downloads are cached (~/.cache/synthesizer-pretrain); a finished stage's output is reused on a rerun. The
last lines are the scores table (beside the majority-class baseline and chance) and where the TensorBoard logs
and the exported model are.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# lines of the children worth showing as progress: our loggers' INFO lines (the table is printed at the end)
_SHOWN = ("INFO pretrain.", "INFO tokenizer.")


def _run(title: str, cmd: list[str], done: Path, log_file: Path, start: float) -> None:
    """Run one stage unless `done` exists; stream its progress lines; stop the demo if it fails."""
    print(f"[{time.perf_counter() - start:6.0f}s] {title}", flush=True)
    if done.exists():
        print(f"         reusing {done}", flush=True)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with log_file.open("w") as log, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            if any(key in line for key in _SHOWN):
                print("         " + line.split(": ", 1)[-1].rstrip(), flush=True)
    if proc.returncode != 0:
        print(f"demo: stage '{title}' failed (exit {proc.returncode}); its output is in {log_file}", file=sys.stderr)
        raise SystemExit(proc.returncode)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/demo", help="folder for every output of the demo")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="optimizer steps of the pretraining")
    parser.add_argument("--fresh", action="store_true", help="remove --work first instead of reusing its stages")
    args = parser.parse_args(argv)
    work = (REPO / args.work).resolve()
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    py, start = sys.executable, time.perf_counter()
    launch = [py, "-m", "launch.run", "--nproc-per-node", "2"]  # torchrun with the jobs' exit codes
    text, tok, shards = work / "text", work / "tokenizer", work / "shards"
    pretrain, export, polarity, finetune = work / "pretrain", work / "export", work / "polarity", work / "finetune"
    stages = [
        ("text: Wikipedia + news in C4's layout", [py, "-m", "pretrain.data.fetch", "--output", str(text)],
         text / "c4-validation.00000-of-00001.json.gz"),
        ("tokenizer: SentencePiece, 1000 pieces + 100 sentinels",
         [py, "-m", "tokenizer.train", "--input", str(text / "c4-train.*.json.gz"), "--output", str(tok),
          "--vocab-size", "1000"], tok / "spiece.model"),
        ("shards: train", [py, "-m", "pretrain.data.prepare", "--input", str(text / "c4-train.*.json.gz"),
                               "--output", str(shards / "train"), "--tokenizer", str(tok / "spiece.model")],
         shards / "train" / "index.json"),
        ("shards: validation", [py, "-m", "pretrain.data.prepare", "--input", str(text / "c4-validation.*.json.gz"),
                                    "--output", str(shards / "valid"), "--tokenizer", str(tok / "spiece.model")],
         shards / "valid" / "index.json"),
        (f"pretrain: tiny Random+Vanilla Synthesizer, {args.pretrain_steps} steps, 2 processes (data parallel)",
         launch + ["-m", "pretrain.train", "--config", "configs/tiny.yaml", f"run.dir={pretrain}",
                   f"data.train={shards / 'train'}", f"data.valid={shards / 'valid'}",
                   f"data.tokenizer={tok / 'spiece.model'}", f"train.steps={args.pretrain_steps}",
                   "checkpoint.every=0", "eval.every=100", "log.every=50"],
         pretrain / "checkpoints" / "latest"),
        ("export: checkpoint -> model.safetensors + config.json + tokenizer",
         [py, "-m", "pretrain.export", "--run", str(pretrain), "--output", str(export)], export),
        ("polarity: 4,000 movie-review sentences in SST-2's layout",
         [py, "-m", "pretrain.tasks.polarity", "--output", str(polarity)], polarity / "test.tsv"),
        ("finetune + evaluate: sst2 on the polarity set, tensor parallel over 2 processes",
         launch + ["-m", "pretrain.finetune", "--config", "configs/finetune/polarity.yaml", f"init={export}",
                   f"data.dir={polarity}", f"run.dir={finetune}", "parallel.tensor=2"],
         finetune / "results.json"),
    ]
    for i, (title, cmd, done) in enumerate(stages):
        _run(f"{i + 1}/{len(stages)} {title}", cmd, done, work / "logs" / f"stage{i + 1}.log", start)
    print(f"\n[{time.perf_counter() - start:6.0f}s] done. Scores (dev set, %; _rank: rank classification), each "
          "beside the majority-class baseline and chance:\n")
    print((finetune / "results.md").read_text())
    print(f"exported model:   {export}  (loads with AutoModelForSeq2SeqLM.from_pretrained(..., "
          "trust_remote_code=True) or pretrain.transfer.exporting.load_pretrained)")
    print(f"TensorBoard logs: tensorboard --logdir {work}  (pretrain/tensorboard, finetune/tensorboard)")
    print(f"results:          {finetune / 'results.json'}; test predictions {finetune / 'submission' / 'SST-2.tsv'}")


if __name__ == "__main__":
    main()
