"""The training loop on real gloo process groups, the tiny config and real text shards.

Runs are shared between assertions where that is honest: the ZeRO-0 run is also the "loss falls" and
"metrics contract" run; the ZeRO-1 run is the uninterrupted reference of the resume tests
(tests/test_resume.py launches like `srun` does and compares against it); the TP=1 runs that the TP=2 runs
are compared with also provide the checkpoint that a TP=2 run resumes (layout change, universal checkpoint).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.core.config import Config, load_config
from pretrain.runtime.faults import EXIT_DIVERGED, EXIT_FAILED, EXIT_PREEMPTED
from tests.distributed import disk_full, launch_like_srun, run_distributed
from tests.test_metrics import read_metrics, read_tensorboard

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 8
# every step logged, evaluation and a checkpoint every 4 steps; 8 steps at lr warmup 10 (tiny.yaml)
COMMON = [f"train.steps={STEPS}", "log.every=1", "eval.every=4", "checkpoint.every=4", "checkpoint.keep=2"]
# the layouts whose optimizers must skip a step with non-finite gradients: plain fp32 (our guard), ZeRO's, bf16's
INF_VARIANTS = {"zero0": ["zero.stage=0"], "zero1": ["zero.stage=1"],
                "bf16": ["zero.stage=1", "precision=bf16", "parallel.backend=gloo"]}
# an inf gradient with a finite loss (backward only): every ZeRO stage, fp32 and bf16
INF_GRAD_VARIANTS = {f"{precision}_zero{stage}": [f"zero.stage={stage}", f"precision={precision}",
                                                   "parallel.backend=gloo"]
                     for precision in ("fp32", "bf16") for stage in range(4)}


def data_overrides(shards, workers: int = 0) -> list[str]:
    """The fixture shards; in-process groups read without DataLoader workers (daemonic processes cannot
    have children), which gives the same batches as 1 worker (one stream per DP rank either way)."""
    return [f"data.train={shards.train}", f"data.valid={shards.valid}", f"data.tokenizer={shards.tokenizer}",
            f"data.workers={workers}"]


def _train_each(rank: int, world_size: int, runs: list[tuple[str, list[str], str | None]]) -> list[int | str]:
    """In one process group, train every (run_dir, overrides, fault) in turn; returns the exit codes, or the
    message of a UsageError (a refused config) for a run that raised one.

    Faults are injected in this process: ("inf", calls) makes an activation of rank 1 infinite (the output of
    the first encoder feed-forward) at its forward calls `calls`; ("inf_grad", calls) makes only the gradient of
    that output infinite (the forward and the loss stay finite); "diverge" does so at calls 3, 5 and 6 and runs
    through `main` (which then tears the process group down: it must come last); "sigterm" sends SIGTERM to
    rank 1 itself after its second step.
    """
    from pretrain import train as train_module
    from pretrain.core.config import UsageError
    from pretrain.runtime import loop as loop_module

    codes = []
    for run_dir, overrides, fault in runs:
        argv = ["--config", TINY, f"run.dir={run_dir}", *overrides]
        if fault == "diverge":
            with inf_activation_at({3, 5, 6} if rank == 1 else set()):
                codes.append(train_module.main(argv))
        elif isinstance(fault, tuple):
            with inf_activation_at(fault[1] if rank == 1 else set(), backward_only=fault[0] == "inf_grad"):
                codes.append(train_module.train(load_config(Config, TINY, argv[2:])))
        elif fault == "sigterm":
            with _signal_after_steps(2 if rank == 1 else None, loop_module):
                codes.append(train_module.train(load_config(Config, TINY, argv[2:])))
        else:
            try:
                codes.append(train_module.train(load_config(Config, TINY, argv[2:])))
            except UsageError as e:
                codes.append(str(e))
    return codes


@contextlib.contextmanager
def inf_activation_at(calls: set[int], backward_only: bool = False):
    """The first encoder layer's feed-forward output becomes +inf at the model's forward calls `calls` (counted
    from 1): a real overflow inside the network, not a NaN put into the loss value. `backward_only`: the output
    stays finite and its gradient becomes +inf (an overflow of the backward alone: the loss is finite)."""
    from pretrain.model.t5 import GatedFFN, T5Model

    forward, ffn_forward, count = T5Model.forward, GatedFFN.forward, [0]
    state = {"armed": False}

    def model_forward(self, *args, **kwargs):
        count[0] += 1
        state["armed"] = count[0] in calls
        return forward(self, *args, **kwargs)

    def ffn(self, x):
        out = ffn_forward(self, x)
        if state["armed"]:
            state["armed"] = False  # once per forward: the first feed-forward reached
            if backward_only:
                out.register_hook(lambda grad: grad + float("inf"))
            else:
                out = out + float("inf")
        return out

    T5Model.forward, GatedFFN.forward = model_forward, ffn
    try:
        yield
    finally:
        T5Model.forward, GatedFFN.forward = forward, ffn_forward


@contextlib.contextmanager
def _signal_after_steps(steps: int | None, loop_module):
    original, count = loop_module.train_step, [0]

    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        count[0] += 1
        if count[0] == steps:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, caught by the loop's handler
        return result

    loop_module.train_step = train_step
    try:
        yield
    finally:
        loop_module.train_step = original


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def zero_runs(shards, tmp_path_factory) -> dict[int | str, Path]:
    """In one TP 1 x DP 2 group, fp32, the same seed and data: {stage: run_dir} for ZeRO 0-3, "stopped":
    ZeRO 1 ended by train.exit_after=3; inf activations in micro batch 2 of 4 of step 2 at ZeRO 0 and ZeRO 1
    (fp32) and bf16, each beside its clean twin; an inf gradient alone at the same place at ZeRO 0-3 in fp32 and
    bf16; "diverge": ZeRO 1 with three overflows (exits EXIT_DIVERGED)."""
    root = tmp_path_factory.mktemp("zero")
    base = [*COMMON, *data_overrides(shards)]
    runs = [(str(root / f"zero{s}"), [*base, f"zero.stage={s}"], None) for s in range(4)]
    runs.append((str(root / "stopped"), [*base, "zero.stage=1", "train.exit_after=3"], None))
    # micro batch 1 x accumulation 4 x DP 2: forward calls 5-8 of rank 1 are step 2, call 6 its micro batch 2
    accumulate = ["train.micro_batch=1", "eval.every=0", "train.steps=4"]
    for name, extra in INF_VARIANTS.items():
        runs.append((str(root / f"clean_{name}"), [*base, *accumulate, *extra], None))
        runs.append((str(root / f"inf_{name}"), [*base, *accumulate, *extra], ("inf", {6})))
    for name, extra in INF_GRAD_VARIANTS.items():
        runs.append((str(root / f"inf_grad_{name}"), [*base, *accumulate, *extra], ("inf_grad", {6})))
    runs.append((str(root / "diverge"), [*base, "zero.stage=1", "checkpoint.every=2", "train.max_skipped_steps=2"],
                 "diverge"))
    assert run_distributed(_train_each, 2, runs) == \
        [[0] * (5 + 2 * len(INF_VARIANTS) + len(INF_GRAD_VARIANTS)) + [EXIT_DIVERGED]] * 2
    return {p.name if not p.name.startswith("zero") else int(p.name[4:]): p for p in root.iterdir()}


def test_loss_falls_on_real_text(zero_runs):
    curve = losses(zero_runs[0])
    assert len(curve) == STEPS
    # a fresh model starts near a uniform guess over the vocabulary (the lm_head as Mesh TF draws it), and 8 warm-up
    # steps on real text take it half a nat below one (7.33 -> 6.27)
    uniform = math.log(load_config(Config, TINY).model.vocab_size)
    assert abs(curve[0] - uniform) < 1.0 and curve[-1] < uniform - 0.5, curve


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_zero0(zero_runs, stage):
    reference = losses(zero_runs[0])
    torch.testing.assert_close(losses(zero_runs[stage]), reference, rtol=1e-5, atol=0)
    grad_norms = [[r["grad_norm"] for r in read_metrics(zero_runs[s])] for s in (0, stage)]
    torch.testing.assert_close(grad_norms[1], grad_norms[0], rtol=1e-4, atol=0)
    # mixture weights are read from the (ZeRO-3: gathered) parameters
    mixtures = [{k: v for k, v in read_metrics(zero_runs[s])[-1].items() if k.startswith("mixture/")} for s in (0, stage)]
    assert mixtures[1] == pytest.approx(mixtures[0], rel=1e-4)


def test_metrics_contract_and_tensorboard_read_back(zero_runs):
    run = zero_runs[0]
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert [("eval_loss" in r) for r in records] == [s % 4 == 0 for s in range(1, STEPS + 1)]
    assert all(0 <= r["eval_accuracy"] <= 1 for r in records if "eval_accuracy" in r)
    # lr follows the warmup of tiny.yaml: the t-th update uses 3e-3 * t / 10
    assert [r["lr"] for r in records] == pytest.approx([3e-3 * t / 10 for t in range(1, STEPS + 1)])
    # mixture weights of every layer of random+vanilla, summing to 1
    mix = {k: v for k, v in records[-1].items() if k.startswith("mixture/")}
    assert len(mix) == 2 * 4  # 2 encoder + 2 decoder layers x (random, vanilla)
    assert mix["mixture/encoder.layers.0/random"] + mix["mixture/encoder.layers.0/vanilla"] == pytest.approx(1)
    scalars = read_tensorboard(run)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss", "mixture/decoder.layers.1/random"):
        logged = [(r["step"], r[key]) for r in records if key in r]
        assert [s for s, _ in scalars[key]] == [s for s, _ in logged]
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in logged], rel=1e-6)
    assert (run / "config.yaml").is_file()
    # pictures of the learned random matrices and of the mixture weights at the evaluation steps, the config
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0}).Reload()
    images = events.Tags()["images"]
    assert any(t.startswith("synthesizer/encoder.layers.0") for t in images), images
    assert any(t.startswith("mixture_heads/") for t in images), images
    assert [e.step for e in events.Images(images[0])] == [4, 8]
    assert any(t.startswith("config") for t in events.Tags()["tensors"])
    assert [s for s, _ in scalars["by_tokens/loss"]] == [r["tokens_seen"] for r in records]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{STEPS}"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_4", "step_8"]
    state = json.loads((checkpoints / "step_8" / "trainer_state.json").read_text())
    # the step's metrics record (without the evaluation, which follows the save, and the save's own timings): a
    # resume writes a lost line again
    assert state.pop("record") == {k: v for k, v in records[-1].items()
                                   if not k.startswith(("eval", "checkpoint_")) and k != "step"}
    assert state == {"step": 8, "tokens_seen": 8 * 8 * (64 + 14), "skipped_steps": 0, "tp": 1, "dp": 2,
                     "precision": "fp32", "zero_stage": 0}
    assert sorted(p.name for p in (checkpoints / "step_8").glob("data_dp*.pt")) == ["data_dp0.pt", "data_dp1.pt"]


@pytest.fixture(scope="module")
def tp_runs(shards, tmp_path_factory) -> dict[str, Path]:
    """vanilla and mixture at TP 1 (world 1) and TP 2 (world 2), DP 1 in both, so the data is the same.

    The TP 2 group also resumes the TP 1 mixture run from its step 4 (layout change: universal checkpoint), in
    two starts of the same command (a requeue after train.exit_after).
    The 1100 token ids take 1152 rows at TP 1 and 1280 at TP 2: the model pads them itself.
    """
    root = tmp_path_factory.mktemp("tp")
    base = [*COMMON, *data_overrides(shards), "eval.every=0"]
    # vanilla at ZeRO 0 (the gradient norm is ours: loop.grad_norm_over_tp), the mixture at tiny.yaml's ZeRO 1
    variants = {"vanilla": ["model.encoder_attention=vanilla", "model.decoder_attention=vanilla", "zero.stage=0"],
                "mixture": ["model.encoder_attention=dense+vanilla", "model.decoder_attention=random+vanilla"]}
    tp1 = [(str(root / f"{name}_tp1"), [*base, *extra], None) for name, extra in variants.items()]
    assert run_distributed(_train_each, 1, tp1) == [[0, 0]]
    tp2 = [(str(root / f"{name}_tp2"), [*base, *extra, "parallel.tensor=2"], None) for name, extra in variants.items()]
    # resumed from the TP 1 run's step 4, stopped after 2 steps, then requeued with the same command line: the
    # second start continues from the run's own step 6, not from checkpoint.resume's step 4 again
    resumed = (str(root / "mixture_resumed_tp2"), [*base, *variants["mixture"], "parallel.tensor=2",
                                                   f"checkpoint.resume={root / 'mixture_tp1'}/checkpoints/step_4",
                                                   "train.exit_after=2"], None)
    assert run_distributed(_train_each, 2, [*tp2, resumed, resumed]) == [[0, 0, 0, 0]] * 2
    return {p.name: p for p in root.iterdir()}


@pytest.mark.parametrize("variant", ["vanilla", "mixture"])
def test_tp2_matches_tp1(tp_runs, variant):
    reference = losses(tp_runs[f"{variant}_tp1"])
    assert len(reference) == STEPS
    torch.testing.assert_close(losses(tp_runs[f"{variant}_tp2"]), reference, rtol=1e-5, atol=0)
    # the norm counts every parameter once: a replicated one (RMSNorm scales) is not summed over the TP ranks
    grad_norms = [[r["grad_norm"] for r in read_metrics(tp_runs[f"{variant}_tp{tp}"])] for tp in (1, 2)]
    torch.testing.assert_close(grad_norms[1], grad_norms[0], rtol=1e-4, atol=0)


def test_resume_on_another_tp_layout_continues_the_curve(tp_runs):
    resumed = read_metrics(tp_runs["mixture_resumed_tp2"])
    assert [r["step"] for r in resumed] == list(range(5, STEPS + 1))
    reference = losses(tp_runs["mixture_tp1"])[4:]
    torch.testing.assert_close([r["loss"] for r in resumed], reference, rtol=1e-5, atol=0)
    assert (tp_runs["mixture_tp1"] / "checkpoints" / "step_4_universal" / "zero").is_dir()
    assert sorted(p.name for p in (tp_runs["mixture_resumed_tp2"] / "checkpoints").glob("step_*")) == ["step_6",
                                                                                                    "step_8"]


def test_resume_on_fewer_then_more_dp_ranks_trains_on_the_same_examples(zero_runs, tmp_path):
    # the ZeRO 1 run at DP 2 (micro 4 x accumulation 1) is the uninterrupted reference; its step 4 resumed at DP 1
    # with micro 2 x accumulation 4 for 2 steps, then requeued on 4 ranks (micro 1 x accumulation 2) to the end:
    # the same examples in the same global batches, so (dropout 0) the same losses up to summation order, and the
    # same evaluation examples, so the same eval loss
    reference = read_metrics(zero_runs[1])
    run = [(str(tmp_path / "resumed"), [*COMMON, *data_overrides_of(zero_runs[1]), "zero.stage=1",
                                        f"checkpoint.resume={zero_runs[1]}/checkpoints/step_4"], None)]
    assert run_distributed(_train_each, 1, [(run[0][0], [*run[0][1], "train.micro_batch=2", "train.exit_after=2"],
                                             None)]) == [[0]]
    assert run_distributed(_train_each, 4, [(run[0][0], [*run[0][1], "train.micro_batch=1"], None)]) == [[0]] * 4
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed if "loss" in r] == list(range(5, STEPS + 1))
    torch.testing.assert_close([r["loss"] for r in resumed if "loss" in r], losses(zero_runs[1])[4:], rtol=1e-5,
                               atol=0)
    evals = lambda records: [r["eval_loss"] for r in records if "eval_loss" in r]
    torch.testing.assert_close(evals(resumed)[-1:], evals(reference)[-1:], rtol=1e-5, atol=0)
    assert resumed[-1]["tokens_seen"] == reference[-1]["tokens_seen"]


def test_a_resume_with_another_precision_or_zero_stage_continues_or_is_one_line(zero_runs, tmp_path):
    # the fp32 ZeRO 1 run's step 4, resumed in bf16, at ZeRO 2, 3 and 0: before, each ended in DeepSpeed tracebacks
    # on every rank (bf16: FileNotFoundError for bf16_zero_pp_rank_*; 3: AssertionError; 0: AttributeError)
    step_4 = zero_runs[1] / "checkpoints" / "step_4"
    base = [*COMMON, *data_overrides_of(zero_runs[1]), f"checkpoint.resume={step_4}"]
    cases = {"zero2": ["zero.stage=2"], "bf16": ["precision=bf16", "parallel.backend=gloo"], "zero3": ["zero.stage=3"],
             "zero0": ["zero.stage=0"]}
    codes = run_distributed(_train_each, 2, [(str(tmp_path / name), [*base, *extra], None)
                                             for name, extra in cases.items()])
    refusal = f"cannot resume {step_4} with zero.stage 1 -> {{}}: DeepSpeed carries a checkpoint across that only as a " \
              "universal checkpoint, "
    assert codes[0][:2] == [0, 0] and codes[0] == codes[1]
    assert codes[0][2].startswith(refusal.format(3)) and "resume with zero.stage 1 or 2" in codes[0][2]
    assert codes[0][3].startswith(refusal.format(0)) and "which needs ZeRO >= 1 on both sides" in codes[0][3]
    # through the universal checkpoint: ZeRO 2 continues the ZeRO 1 curve exactly (fp32), bf16 within its rounding
    reference = losses(zero_runs[1])[4:]
    torch.testing.assert_close(losses(tmp_path / "zero2"), reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(losses(tmp_path / "bf16"), reference, rtol=1e-2, atol=0)
    assert [r["step"] for r in read_metrics(tmp_path / "bf16")] == list(range(5, STEPS + 1))
    # what each checkpoint was written with is in its trainer_state.json
    written = [json.loads((tmp_path / name / "checkpoints" / "step_8" / "trainer_state.json").read_text())
               for name in ("zero2", "bf16")]
    assert [(w["precision"], w["zero_stage"]) for w in written] == [("fp32", 2), ("bf16", 1)]


def data_overrides_of(run_dir: Path) -> list[str]:
    """The data keys of an earlier run, read from its resolved config."""
    import yaml

    data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    return [f"data.{k}={data[k]}" for k in ("train", "valid", "tokenizer", "workers")]


# ------------------------------------------------------------------------------------------------------
# Faults and exact resume: stop (exit_after) -> killed during a save -> SIGTERM -> finish == uninterrupted
# ------------------------------------------------------------------------------------------------------
_HALF_WRITTEN = """
import os, signal, sys
from pretrain.runtime import checkpoint
original = checkpoint._save_torch
def save(obj, path):  # rank 1 dies with its data-position file half written
    original(obj, path)
    if os.environ["RANK"] == "1" and path.name.startswith("data_dp"):
        os.truncate(path, path.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint._save_torch = save
from pretrain.train import main
sys.exit(main())
"""
TRAIN = "import sys; from pretrain.train import main; sys.exit(main())"


def test_stop_kill_disk_full_preempt_resume_equals_uninterrupted(zero_runs, shards):
    run = zero_runs["stopped"]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_3"  # exit_after=3 saved and stopped
    overrides = [*COMMON, *data_overrides(shards), "zero.stage=1"]
    # launched as `srun` does, with a DataLoader worker process (the same batches as none, see data_overrides):
    # rank 1 is killed with a file half written while saving step 4; rank 0 fails instead of hanging
    argv = ["--config", TINY, f"run.dir={run}", *COMMON, *data_overrides(shards, workers=1), "zero.stage=1"]
    codes = [code for code, _ in launch_like_srun(2, _HALF_WRITTEN, argv, cwd=REPO)]
    assert codes == [EXIT_FAILED, -signal.SIGKILL]
    assert not (checkpoints / "step_4" / "complete.json").exists()
    assert (checkpoints / "latest").read_text().strip() == "step_3"
    # the disk fills up during the next save of step 4: every rank fails, `latest` stays
    results = launch_like_srun(2, TRAIN, argv, cwd=REPO, preexec_fn=disk_full)
    assert [code for code, _ in results] == [EXIT_FAILED] * 2
    assert "rank 0: checkpoint step_4 not saved: file too large (EFBIG): " in results[0][1]  # the 1 MB file limit
    assert "Traceback" not in results[0][1]
    assert (checkpoints / "latest").read_text().strip() == "step_3"
    # resume from step 3 (auto), rank 1 gets SIGTERM after its second step (step 5): step 6's collective carries it,
    # all ranks save step 6 and exit;
    # then run again to the end; then a resume that changed the model shape, one on half of the shards and a fresh
    # start (checkpoint.resume=none) in this run.dir are refused
    changed = [*overrides, "model.d_ff=96"]
    half = [*overrides, f"data.train={shards.train}/shard-{{000000..000003}}.tar"]
    runs = [(str(run), overrides, "sigterm"), (str(run), overrides, None), (str(run), changed, None),
            (str(run), half, None), (str(run), [*overrides, "checkpoint.resume=none"], None)]
    codes = run_distributed(_train_each, 2, runs)
    assert [c[:2] for c in codes] == [[EXIT_PREEMPTED, 0]] * 2
    assert "model.d_ff: 128 in the checkpoint, 96 now" in codes[0][2]
    assert "data.train changed (8 shards in the checkpoint, 4 now; not listed now: shard-000004.tar" in codes[0][3]
    assert f"checkpoint.resume=none, but {run} holds checkpoints of a run (step_6, step_8)" in codes[0][4]
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_6", "step_8"]  # checkpoint.keep=2
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert losses(run) == losses(zero_runs[1])  # exactly: fp32 on CPU
    assert [r.get("eval_loss") for r in records] == [r.get("eval_loss") for r in read_metrics(zero_runs[1])]


@pytest.mark.parametrize("variant", list(INF_VARIANTS))
def test_inf_activation_skips_the_whole_step_everywhere(zero_runs, variant):
    clean, run = read_metrics(zero_runs[f"clean_{variant}"]), read_metrics(zero_runs[f"inf_{variant}"])
    assert run[0]["loss"] == clean[0]["loss"]  # step 1 is untouched
    assert [r["lr"] for r in run] == [r["lr"] for r in clean]
    _assert_step_2_skipped_once(zero_runs[f"inf_{variant}"])


@pytest.mark.parametrize("variant", list(INF_GRAD_VARIANTS))
def test_inf_gradient_with_a_finite_loss_skips_the_whole_step_everywhere(zero_runs, variant):
    # DeepSpeed reports a non-finite gradient norm as -1.0: a check of loss + norm alone would apply this step
    _assert_step_2_skipped_once(zero_runs[f"inf_grad_{variant}"])


def _assert_step_2_skipped_once(run_dir: Path) -> None:
    """The attempt at step 2 was skipped on every rank and the run went on: no update, no LR-schedule step, its
    batches consumed, finite weights, DeepSpeed's count of applied steps equal to the trainer's."""
    run = read_metrics(run_dir)
    assert [(r["step"], r["skipped_steps"]) for r in run] == [(1, 0), (2, 1), (3, 1), (4, 1)]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in run)
    # the skipped attempt advanced neither the LR schedule nor the step count: step t still uses lr(t)
    assert [r["lr"] for r in run] == pytest.approx([3e-3 * t / 10 for t in range(1, 5)])
    assert run[-1]["tokens_seen"] == 5 * 8 * (64 + 14)  # the skipped step's batches were consumed
    step4 = run_dir / "checkpoints" / "step_4"
    states = sorted(step4.glob("*mp_rank_00_model_states.pt"))[0]  # zero_pp_rank_0_mp_rank_00_... at ZeRO 3
    deepspeed_state = torch.load(states, weights_only=False, map_location="cpu")
    # the trainer's count is DeepSpeed's: 5 optimizer calls, 1 of them not applied
    assert (deepspeed_state["global_steps"], deepspeed_state["skipped_steps"]) == (5, 1)
    assert json.loads((step4 / "trainer_state.json").read_text())["skipped_steps"] == 1
    # the weights (ZeRO 3: only in the optimizer's partitions) and the optimizer's moments are finite
    optimizer = [torch.load(f, weights_only=False, map_location="cpu") for f in step4.glob("*optim_states.pt")]
    tensors = [t for t in _tensors([deepspeed_state, optimizer]) if t.is_floating_point()]
    assert tensors and all(torch.isfinite(t.float()).all() for t in tensors)


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for item in obj for t in _tensors(item)] if isinstance(obj, (list, tuple)) else []


def test_repeated_overflows_stop_the_run_on_the_last_good_checkpoint(zero_runs):
    run = zero_runs["diverge"]
    records = read_metrics(run)
    # forward calls 1, 2 -> steps 1, 2 (checkpoint); 3 inf (skipped); 4 -> step 3; 5, 6 inf -> stop naming step 4
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 0), (2, 0), (3, 1)]
    assert records[2]["lr"] == pytest.approx(3e-3 * 3 / 10)  # the skipped step did not advance the schedule
    assert all(math.isfinite(r["loss"]) for r in records)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"


def test_a_run_whose_first_attempt_is_skipped_trains_on(shards, tmp_path):
    """The first attempt of a run (a requeue's too) skipped on every rank: the step is tried again with the next
    batches and the run trains to train.steps. Before, the loop took that attempt for the end of the run (its 0
    applied steps equal to train.exit_after 0, "no limit") and exited 0 at step 0, having trained nothing."""
    run = tmp_path / "first_skipped"
    overrides = [*COMMON, *data_overrides(shards), "train.steps=2", "eval.every=0", "checkpoint.every=0"]
    assert run_distributed(_train_each, 2, [(str(run), overrides, ("inf", {1}))]) == [[0], [0]]
    assert [(r["step"], r["skipped_steps"]) for r in read_metrics(run)] == [(1, 1), (2, 1)]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
