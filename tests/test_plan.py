"""The planner against reality: the activation estimate (a meta-device trace) within 25% of the measured
peak of a real CPU fp32 forward + backward (torch.profiler's allocation events) for every mixer and
recompute mode, and the logits term against its formula; model-state bytes equal to what bench.zero_memory
measures on a real DeepSpeed engine at DP 2 for ZeRO 0-3 in fp32 and ZeRO 0-2 in bf16; the meta shard's
shapes against the unsharded model; the command line's verdicts; the checkpoint's bytes against a real DeepSpeed
save's files, and the warning when saves take over 5% of wall time."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pretrain.core.config import Config, load_config
from pretrain.distributed.parallel import init_single_process, padded_vocab_size
from pretrain.model import MIXERS, build_local_model, build_model
from pretrain.model.mixers import parse_mixers
from pretrain.model.mixers.factorized_dense import factor_pair
from pretrain.plan import main
from pretrain.planning.memory import activation_bytes, meta_model, model_state_bytes, trace_activations
from pretrain.planning.planner import check_job
from tests.distributed import run_distributed
from tests.registry import SPECS, assert_covers

SMALL = ["model.vocab_size=1100", "model.d_model=64", "model.d_kv=16", "model.num_heads=4", "model.d_ff=128",
         "model.max_length=128", "data.input_length=128", "model.num_layers=2", "model.num_decoder_layers=2"]


def _measured_peak(cfg: Config, micro: int, n: int, m: int, mode: str) -> int:
    """Peak bytes allocated during one real forward + backward (gradients pre-allocated: not activations)."""
    torch.manual_seed(0)
    init_single_process()
    model = build_model(cfg.model, activation_checkpointing=mode)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(2, cfg.model.vocab_size, (micro, length), generator=g)
             for k, length in (("input_ids", n), ("decoder_input_ids", m), ("labels", m))}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(**batch).loss.backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("mixer", SPECS)
def test_activation_estimate_within_25_percent_of_measured_peak(mixer, mode):
    cfg = load_config(Config, "configs/tiny.yaml", SMALL + [f"model.encoder_attention={mixer}",
                                                            f"model.decoder_attention={mixer}"])
    micro, n, m = 8, 128, 28
    measured = _measured_peak(cfg, micro, n, m, mode)
    estimate = activation_bytes(trace_activations(cfg, 1, micro, m, device="cpu"), mode)
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate, measured)


@pytest.mark.parametrize("mixer", ["vanilla", "dense", "dense+vanilla"])
def test_fused_attention_needs_no_logit_memory_and_the_estimate_counts_it(mixer):
    # position_bias none: CPU training runs the fused kernel (pretrain/model/attention.py `_fused`), which stores
    # nothing of size [b, heads, n, m]: from encoder length 1024 to 2048 the peak grows by the linear activations
    # alone (materialised, each layer's probabilities alone are 64 MiB at 2048); the planner's CPU trace counts the
    # kernel's saved tensors, not the meta dispatch's math path
    peaks = {}
    for n in (1024, 2048):
        cfg = load_config(Config, "configs/tiny.yaml", SMALL + [
            f"model.encoder_attention={mixer}", f"model.decoder_attention={mixer}", "model.position_bias=none",
            f"model.max_length={n}", f"data.input_length={n}"])
        peaks[n] = _measured_peak(cfg, 1, n, 28, "none")
        estimate = activation_bytes(trace_activations(cfg, 1, 1, 28, device="cpu"), "none")
        assert 0.75 * peaks[n] <= estimate <= 1.25 * peaks[n], (n, estimate, peaks[n])
    assert peaks[2048] - peaks[1024] < 40 * 2**20, peaks


def test_cuda_estimate_counts_the_mask_gradient_of_the_memory_efficient_backward():
    # a trained mask (T5's bias [1, heads, n, n]) makes CUDA's memory-efficient backward allocate its gradient at
    # [b, heads, n, n] (one layer at a time); with position_bias none there is none
    for position_bias, expected in (("all", 8 * 4 * 128 * 128 * 2), ("none", 0)):
        cfg = load_config(Config, "configs/tiny.yaml", SMALL + ["precision=bf16", f"model.position_bias={position_bias}",
                                                                "model.encoder_attention=dense+vanilla",
                                                                "model.decoder_attention=dense+vanilla"])
        trace = trace_activations(cfg, 1, 8, 28, device="cuda")
        assert trace.attention_backward == expected
        without = activation_bytes(dataclasses.replace(trace, attention_backward=0), "selective")
        assert activation_bytes(trace, "selective") == without + expected


@pytest.mark.parametrize("mixer", ["vanilla", "random+vanilla"])
def test_activation_estimate_counts_dropout_masks(mixer):
    cfg = load_config(Config, "configs/tiny.yaml", SMALL + [f"model.encoder_attention={mixer}",
                                                            f"model.decoder_attention={mixer}", "model.dropout=0.1"])
    measured = _measured_peak(cfg, 8, 128, 28, "none")
    estimate = activation_bytes(trace_activations(cfg, 1, 8, 28, device="cpu"), "none")
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate, measured)


def _zero_states(rank: int, world: int) -> list[tuple[str, int, int, dict[str, int]]]:
    """bench.zero_memory's measurement of a real engine at DP `world`: fp32 at ZeRO 0-3, bf16 at ZeRO 0-2 (the
    precision of the cluster, over gloo on CPU); with the parameter count."""
    from bench.zero_memory import MODEL_OVERRIDES, _measure
    from pretrain.core.config import ParallelConfig
    from pretrain.distributed.parallel import init_distributed
    from pretrain.runtime.engine import build_engine

    cfg = load_config(Config, "configs/tiny.yaml", MODEL_OVERRIDES)
    init_distributed(ParallelConfig(tensor=1), cfg.run.seed)
    g = torch.Generator().manual_seed(rank)
    batch = {k: torch.randint(2, 1100, (4, length), generator=g)
             for k, length in (("input_ids", 64), ("decoder_input_ids", 14), ("labels", 14))}
    train = dataclasses.replace(cfg.train, micro_batch=4, global_batch=4 * world)
    rows = []
    for precision, stage in [("fp32", 0), ("fp32", 1), ("fp32", 2), ("fp32", 3), ("bf16", 0), ("bf16", 1), ("bf16", 2)]:
        model = build_model(cfg.model)
        num_params = sum(p.numel() for p in model.parameters())  # before ZeRO 3 empties them
        engine = build_engine(model, train, dataclasses.replace(cfg.zero, stage=stage), precision, world)
        rows.append((precision, stage, num_params, _measure(engine, batch)))
    return rows


def test_model_state_bytes_equal_bench_zero_memory():
    for precision, stage, num_params, measured in run_distributed(_zero_states, 2)[0]:
        expected = dict(zip(("params", "grads", "optimizer"),
                            model_state_bytes(num_params, precision, stage, 2, "adamw")))
        if (precision, stage) == ("fp32", 1):
            # ZeRO 1 reduces the whole fp32 gradient into this rank's partition at the end of the backward, where
            # bench.zero_memory looks; the planner counts the whole gradient, which lives until then
            assert expected["grads"] == 4 * num_params
            expected["grads"] = 4 * num_params // 2
        if (precision, stage) == ("bf16", 0):
            # without ZeRO the bf16 gradient is all there is after the backward; the planner adds the fp32 copy
            # that the step makes of it
            assert expected["grads"] == (2 + 4) * num_params
            expected["grads"] = 2 * num_params
        for key, value in expected.items():
            # ZeRO pads each flat partition to an alignment boundary: a few hundred bytes at most
            assert abs(measured[key] - value) <= 1024, (precision, stage, key, measured[key], value)


@pytest.mark.parametrize("tp, precision", [(1, "fp32"), (2, "bf16")])
def test_logits_term_is_the_returned_logits(tp, precision):
    # the logits [b, m, vocab rows / TP] live from the forward to the backward beside everything else; in the
    # 25% band above they are a few percent of the peak, so a lost term would not show there
    cfg = load_config(Config, "configs/tiny.yaml", SMALL + [f"precision={precision}"])
    trace = trace_activations(cfg, tp, 8, 28, device="cpu")
    assert trace.logits == 8 * 28 * padded_vocab_size(1100, tp) // tp * (4 if precision == "fp32" else 2)
    for mode in ("none", "full", "selective"):
        without = activation_bytes(dataclasses.replace(trace, logits=0), mode)
        assert activation_bytes(trace, mode) == without + trace.logits, mode


def test_meta_shard_shapes_are_the_unsharded_model_split_by_tp():
    cfg = load_config(Config, "configs/tiny.yaml", ["model.vocab_size=1100", "model.mixture_per_head=true"])
    full = {name: p for name, p in build_local_model(cfg.model).named_parameters()}
    state = torch.get_rng_state()
    shard = dict(meta_model(cfg, 2).named_parameters())
    assert torch.equal(state, torch.get_rng_state())  # nothing drawn: the trainer's init stream is untouched
    assert set(shard) == set(full)
    for name, p in shard.items():
        expect = list(full[name].shape)
        if getattr(full[name], "tensor_model_parallel", False):
            dim = full[name].partition_dim
            # vocabulary rows: 1100 ids padded to 1152 at TP 1, to 1280 at TP 2
            expect[dim] = 1280 // 2 if expect[dim] == 1152 else expect[dim] // 2
        assert list(p.shape) == expect, name
        assert p.device.type == "meta"


def test_check_job_layout_and_auto_micro_batch():
    cfg = load_config(Config, "configs/base.yaml", ["train.micro_batch=auto"])
    layout = check_job(cfg, world=32, gpu_memory_bytes=80 * 2**30)
    assert (layout.tp, layout.dp) == (1, 32)
    assert layout.micro_batch * layout.accumulation * layout.dp == cfg.train.global_batch
    assert layout.tokens_per_step == cfg.train.global_batch * (512 + 114)
    tiny = check_job(cfg, world=32, gpu_memory_bytes=2**30)  # a 1 GiB device: the smallest micro batch
    assert tiny.micro_batch < layout.micro_batch
    with pytest.raises(ValueError, match=r"train.micro_batch \(many\) must be an integer >= 1 or auto"):
        check_job(load_config(Config, "configs/base.yaml", ["train.micro_batch=many"]), world=8)
    with pytest.raises(ValueError, match=r"train.global_batch \(1024\) must equal train.micro_batch \(32\)"):
        check_job(load_config(Config, "configs/base.yaml", ["train.micro_batch=32"]), world=24)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_planner_verdicts(capsys):
    shape = ("--config", "configs/xl.yaml", "--nodes", "1", "--gpus-per-node", "8")
    code, out, err = _plan(capsys, *shape)
    assert code == 0, err
    assert "TP 1 x DP 8" in out and out.strip().splitlines()[-1].startswith("fits: ")
    code, out, err = _plan(capsys, *shape, "--gpu-memory-gb", "40", "train.activation_checkpointing=none",
                           "train.micro_batch=32")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("pretrain.plan: does not fit")
    assert "set train.activation_checkpointing=full" in err  # selective is not enough at 40 GiB
    code, out, err = _plan(capsys, *shape, "parallel.tensor=3")
    assert code == 2 and "parallel.tensor (3) must divide the world size (8)" in err
    # before: a whole layout planned, then "does not fit ... add GPUs"
    code, out, err = _plan(capsys, *shape, "--gpu-memory-gb", "0")
    assert (code, out, err) == (2, "", "pretrain.plan: --gpu-memory-gb (0.0) must be > 0\n")


def test_trainer_side_check_leaves_the_real_process_groups_alone():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pretrain.planning.planner import check_memory

    init_single_process()  # a launched process: real groups (TP 1) exist
    group, all_reduce = parallel_state.get_tensor_model_parallel_group(), dist.all_reduce
    cfg = load_config(Config, "configs/xl.yaml", ["parallel.tensor=2", "train.micro_batch=4"])
    layout = check_job(cfg, world=2)
    estimate = check_memory(cfg, layout, 80 * 2**30)  # traced as TP rank 0 of 2
    assert estimate.num_params < 2.85e9 * 0.55
    assert parallel_state.get_tensor_model_parallel_group() is group and dist.all_reduce is all_reduce
    assert parallel_state.get_tensor_model_parallel_world_size() == 1 and dist.is_initialized()
    with pytest.raises(ValueError, match=r"^does not fit: needs [0-9.]+ GiB per GPU of 8 GiB"):
        check_memory(cfg, layout, 8 * 2**30)


PAPER_VARIANTS = ["vanilla", "random", "factorized_random", "dense", "random+vanilla", "dense+vanilla",
                  "random(position_bias=none)"]


@pytest.mark.parametrize("nodes", [1, 4])
def test_paper_scale_study_passes_the_planner(capsys, nodes):
    """configs/study/base_c4.yaml through pretrain.study_plan: every variant's pretraining fits 80 GB GPUs at
    1 x 8 and 4 x 8; its FLOPs per step are the planner's for that variant's own job, its GPU-hours those FLOPs
    x steps at 40% of 989 TFLOP/s, and the total those hours x 3 seeds. The ablation's own model setting reaches its
    job."""
    import re

    from pretrain.study_plan import main as study_plan

    code = study_plan(["--config", "configs/study/base_c4.yaml", "--nodes", str(nodes), "--gpus-per-node", "8"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.strip().splitlines()
    assert [line.split()[0] for line in lines[:-1]] == PAPER_VARIANTS
    per_seed = []
    for variant, line in zip(PAPER_VARIANTS, lines):
        assert f"TP 1 x DP {8 * nodes}," in line
        flops, steps, hours = re.search(r"([\d.e+]+) FLOPs/step x ([\d,]+) steps = ([\d.]+) GPU-hours", line).groups()
        assert int(steps.replace(",", "")) == 262144
        assert float(hours) == pytest.approx(float(flops) * 262144 / (989e12 * 0.4) / 3600, abs=0.06)
        per_seed.append(float(hours))
        if nodes == 1:  # the FLOPs do not depend on the layout: compared once
            mixers, _, setting = variant.rstrip(")").partition("(")
            assert main(["--config", "configs/base.yaml", "train.global_batch=128", f"model.encoder_attention={mixers}",
                         f"model.decoder_attention={mixers}", *([f"model.{setting}"] if setting else [])]) == 0
            assert f"model FLOPs per step: {float(flops):.3e}" in capsys.readouterr().out
    total = re.search(r"cells \(7 variants x 3 seeds\): ([\d,]+) GPU-hours at 40% MFU", lines[-1]).group(1)
    assert float(total.replace(",", "")) == pytest.approx(3 * sum(per_seed), abs=1)
    code = study_plan(["--config", "configs/study/base_c4.yaml", "--nodes", str(nodes), "--gpu-memory-gb", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m pretrain.study_plan: error: variant vanilla: does not fit")


CHECKPOINT_LAYOUTS = [("bf16", 0), ("bf16", 2), ("fp32", 2)]


def _saved_files(rank: int, world: int, root: str, tokenizer: str) -> dict[str, dict[str, int]]:
    """A tiny real DeepSpeed engine (one process) saved by CheckpointManager.save after one step, at each of
    CHECKPOINT_LAYOUTS: {layout: {file: bytes}} of what is on disk."""
    from pathlib import Path

    from pretrain.core.config import ParallelConfig, to_yaml
    from pretrain.distributed.parallel import init_distributed
    from pretrain.model import universal_checkpoint_info
    from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs
    from pretrain.runtime.engine import build_engine

    dims = init_distributed(ParallelConfig(), seed=3)
    found = {}
    for precision, stage in CHECKPOINT_LAYOUTS:
        cfg = load_config(Config, "configs/tiny.yaml", [f"precision={precision}", f"zero.stage={stage}",
                                                         f"data.tokenizer={tokenizer}"])
        model = build_model(cfg.model)
        engine = build_engine(model, dataclasses.replace(cfg.train, micro_batch=2, global_batch=2), cfg.zero,
                              precision, 1)
        folder = Path(root) / f"{precision}_zero{stage}"
        manager = CheckpointManager(cfg.checkpoint, folder, dims, engine=engine, progress=Progress(step=1), data=None,
                                    inputs=RunInputs.of(tokenizer), config_yaml=to_yaml(cfg),
                                    universal_info=universal_checkpoint_info(model, cfg.model.vocab_size))
        ids = torch.randint(2, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
        engine.backward(engine(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :6],
                               labels=ids[:, 1:7]).loss)
        engine.step()  # the optimizer's moments exist after the first step
        path = manager.save(1)
        found[f"{precision}_zero{stage}"] = {p.name: p.stat().st_size for p in path.iterdir()
                                             if p.name != "complete.json"}
    return found


def test_checkpoint_bytes_match_a_real_deepspeed_save(tmp_path, tokenizer_model):
    from pretrain.planning.planner import estimate, plan_checkpoint

    saved = run_distributed(_saved_files, 1, str(tmp_path), tokenizer_model)[0]
    for precision, stage in CHECKPOINT_LAYOUTS:
        files = saved[f"{precision}_zero{stage}"]
        cfg = load_config(Config, "configs/tiny.yaml", [f"precision={precision}", f"zero.stage={stage}",
                                                         f"data.tokenizer={tokenizer_model}"])
        layout = check_job(cfg, world=1)
        est = estimate(cfg, layout, "cpu")
        ckpt = plan_checkpoint(cfg, layout, est)
        # bf16 without ZeRO: the bf16 weights, the fp32 master, m and v in one file (14 bytes a parameter); with
        # ZeRO the weights as trained (2 or 4 bytes) beside the optimizer's partition (12 bytes)
        deepspeed = sum(size for name, size in files.items() if name.endswith("_states.pt"))
        weight_bytes = {"bf16": 2, "fp32": 4}[precision]
        assert deepspeed == pytest.approx(est.num_params * (weight_bytes + 12), rel=0.03), (precision, stage, files)
        # the planner's bytes of the one rank, every file of the save, within 10% (the tiny model's files are
        # 6 MB: the rest is the tokenizer copy, the generators and the text files)
        assert ckpt.first_rank == ckpt.total
        assert ckpt.first_rank == pytest.approx(sum(files.values()), rel=0.1), (precision, stage, ckpt, files)


def test_a_checkpoint_that_takes_over_5_percent_of_wall_time_is_named_once(capsys):
    import re

    shape = ("--config", "configs/small.yaml", "--nodes", "1", "--gpus-per-node", "8")
    code, out, err = _plan(capsys, *shape)  # as shipped: every 2000 steps of ~35 ms, 0.5% of wall time
    assert code == 0 and err == "", err
    line = re.search(r"sync: blocks ([\d.]+) s, ([\d.]+)% of wall time", out)
    assert float(line.group(2)) < 5
    code, out, err = _plan(capsys, *shape, "checkpoint.every=100")
    assert code == 0 and out.strip().splitlines()[-1].startswith("fits: ")
    assert err.count("\n") == 1, err
    warned = re.fullmatch(r"pretrain.plan: warning: checkpoint.every 100 spends ([\d.]+)% of wall time saving "
                          r"\(.*\), over 5%; set checkpoint.every=(\d+) or checkpoint.async_save=true\n", err)
    assert warned and float(warned.group(1)) > 5, err
    # the advice holds: at that every, and asynchronously at 100 (only the host copy blocks), no warning
    for fix in (f"checkpoint.every={warned.group(2)}", "checkpoint.async_save=true"):
        code, out, err = _plan(capsys, *shape, "checkpoint.every=100", fix)
        assert code == 0 and err == "", (fix, err)
    assert "async: blocks" in out and "write in the background" in out
    # a slower filesystem: the save's write at 0.05 GB/s per rank makes the shipped cadence cross 5% too
    code, out, err = _plan(capsys, *shape, "--fs-gbps", "0.05")
    assert code == 0 and "warning: checkpoint.every 2000 spends" in err


def test_sizes_print_in_the_unit_that_fits_and_the_advice_stays_within_the_run(capsys):
    import re

    from pretrain.planning.units import binary_size, count, decimal_size

    assert [count(n) for n in (612, 478_040, 999_600, 2_850_000_000)] == ["612", "478K", "1.00M", "2.85B"]
    assert [binary_size(n) for n in (0, 1_900_000, 1019 * 2**20, 5.31 * 2**30)] == ["0 B", "1.81 MiB", "1.00 GiB",
                                                                                       "5.31 GiB"]
    assert [decimal_size(n) for n in (300, 6_100_000, 39.9e9)] == ["300 B", "6.10 MB", "39.9 GB"]
    # configs/tiny.yaml on 2 GPUs (DP 2, fp32, ZeRO 1): the count and the weights' bytes of the real model, not zeros
    code, out, err = _plan(capsys, "--config", "configs/tiny.yaml", "--nodes", "1", "--gpus-per-node", "2")
    cfg = load_config(Config, "configs/tiny.yaml")
    num_params = sum(p.numel() for p in build_local_model(cfg.model).parameters())
    assert code == 0 and f"model: {count(num_params)} parameters per GPU" in out and num_params < 1e6
    assert re.search(rf"\n  parameters +{re.escape(binary_size(4 * num_params))}\n", out), out
    assert not re.search(r" 0\.00 ", out), out  # no row rounded to nothing
    # its checkpoint.every 20 on a 40-step run: a save of ~5 MB against estimated GPU steps of 0.03 ms is most of the
    # wall time, and no periodic cadence fixes that within the 40 steps: the advice says so instead of every=18350
    advised = re.search(r"set checkpoint\.every=(\d+)", err)
    assert advised and int(advised.group(1)) == 0 and "(one save, at the end of the 40 steps)" in err, err


# per registered mixer, (model config) -> its parameters of one layer that grow with model.max_length N, over all
# heads (the paper's shapes)
LENGTH_BOUND = {
    "vanilla": lambda c: 0,
    "dense": lambda c: c.num_heads * c.d_kv * c.max_length + c.num_heads * c.max_length,  # W2 [h, N, d_kv], b2 [h, N]
    "random": lambda c: c.num_heads * c.max_length**2,  # R: [h, N, N]
    "fixed_random": lambda c: c.num_heads * c.max_length**2,  # the same, frozen
    # W_A [h, a, d_kv], b_A [h, a], W_B [h, b, d_kv], b_B [h, b]; a x b = N
    "factorized_dense": lambda c: c.num_heads * sum(factor_pair(c.max_length)) * (c.d_kv + 1),
    "factorized_random": lambda c: 2 * c.num_heads * c.max_length * c.factorized_k,  # R1, R2: [h, N, k]
}


def test_every_registered_mixer_has_its_length_bound_parameters():
    assert_covers(LENGTH_BOUND, "test_plan.LENGTH_BOUND")


@pytest.mark.parametrize("spec", ["random+vanilla", "dense+vanilla", "vanilla", "+".join(MIXERS)])
def test_the_planner_states_the_parameters_bound_to_max_length(capsys, spec):
    # issue 46: the parameters that grow with model.max_length, by mixer, against the paper's shapes (at TP 2 each
    # rank holds half the heads); none for a vanilla model
    over = [f"model.encoder_attention={spec}", f"model.decoder_attention={spec}", "model.max_length=1024"]
    assert main(["--config", "configs/base.yaml", "--nodes", "1", "--gpus-per-node", "8", "parallel.tensor=2",
                 *over]) == 0
    out = capsys.readouterr().out
    cfg = load_config(Config, "configs/base.yaml", over).model
    layers = cfg.num_layers + (cfg.num_decoder_layers or cfg.num_layers)
    expected = {name: LENGTH_BOUND[name](cfg) * layers // 2 for name in parse_mixers(spec) if LENGTH_BOUND[name](cfg)}
    line = [x for x in out.splitlines() if "bound to model.max_length" in x]
    if not expected:
        assert not line
        return
    from pretrain.planning.memory import length_bound_params
    from pretrain.planning.planner import with_vocab_size

    assert length_bound_params(with_vocab_size(load_config(Config, "configs/base.yaml", [*over, "parallel.tensor=2"])),
                               2) == expected
    assert line and line[0].startswith("  of which bound to model.max_length 1024: ")
