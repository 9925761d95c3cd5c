"""Process-group setup: validation messages; any TP that divides the heads takes the T5 vocabulary; TP 1
and TP 2 start from the same weights and function with a vocabulary that pads differently; the TP x DP layout, RNG streams and mpu checks that the 4-process
TP=2 x DP=2 run of tests/test_tensor_parallel.py applies (one spawn for both)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.core.config import ModelConfig, ParallelConfig, UsageError
from pretrain.distributed.parallel import check_parallel, padded_vocab_size
from tests.distributed import run_distributed


def test_padded_vocab_size():
    assert padded_vocab_size(32100, 1) == 32128
    assert padded_vocab_size(32100, 2) == 32256
    assert padded_vocab_size(1100, 1) == 1152
    assert padded_vocab_size(1152, 1) == 1152


@pytest.mark.parametrize(
    "changes, tp, world, needle",
    [
        ({}, 2, 3, "parallel.tensor (2) must divide the world size (3)"),
        ({"num_heads": 6}, 4, 4, "model.num_heads (6) must be a multiple of parallel.tensor (4)"),
        ({"d_ff": 1030}, 4, 4, "model.d_ff (1030) must be a multiple of parallel.tensor (4)"),
    ],
)
def test_check_parallel_names_both_values(changes, tp, world, needle):
    cfg = dataclasses.replace(ModelConfig(vocab_size=32100, num_heads=8), **changes)
    with pytest.raises(ValueError) as e:
        check_parallel(cfg, tp, world)
    assert needle in str(e.value)
    check_parallel(ModelConfig(vocab_size=32100, num_heads=8), 2, 4)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_any_tp_dividing_the_heads_takes_the_t5_vocabulary(tp):
    # the vocabulary is ids; the model pads its rows, so no vocab_size has to be chosen per TP
    from pretrain.core.config import Config, load_config
    from pretrain.planning.planner import check_job

    cfg = load_config(Config, "configs/xl.yaml", [f"parallel.tensor={tp}", "model.vocab_size=32100"])
    layout = check_job(cfg, world=8)
    assert layout.vocab_rows == padded_vocab_size(32100, tp) and layout.vocab_rows % (128 * tp) == 0


TINY_IDS = ModelConfig(vocab_size=1100, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1,
                       max_length=16, encoder_attention="random+vanilla", decoder_attention="dense+vanilla")


def _padding_rows(rows: torch.Tensor, num_ids: int) -> torch.Tensor:
    """This rank's rows [rows/tp, d] of a vocabulary-parallel tensor that hold no token id (ids >= num_ids)."""
    from megatron.core import parallel_state

    start = parallel_state.get_tensor_model_parallel_rank() * rows.shape[0]
    return rows[max(0, num_ids - start):]


def _padded_step(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss, this rank's logits and the padding rows' total |gradient| of a forward and backward with LM-head
    padding rows that are not zero (what steps leave when the padding is not masked): only the mask keeps
    them out of the loss, so the losses of TP 1 (52 such rows) and TP 2 (180) agree only if it works."""
    with torch.no_grad():
        _padding_rows(model.lm_head.weight, 1100).normal_(0.0, 10.0, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    out = model(**{k: torch.randint(2, 1100, (2, 9), generator=g) for k in ("input_ids", "decoder_input_ids", "labels")})
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), _padding_rows(model.lm_head.weight.grad, 1100).abs().sum()


def _start(rank: int, world: int, tp: int) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights gathered to full shape, then `_padded_step`'s loss, full logits and padding gradient at TP `tp`."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pretrain.distributed.parallel import init_distributed
    from pretrain.model import build_model, full_state_dict

    init_distributed(ParallelConfig(tensor=tp), seed=7)
    torch.manual_seed(7)
    model = build_model(TINY_IDS)
    weights = full_state_dict(model)
    loss, logits, padding_grad = _padded_step(model)
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return weights, loss, torch.cat(parts, dim=-1), padding_grad


def test_tp1_and_tp2_start_from_the_same_function_with_unpadded_ids():
    # 1100 ids: 1152 rows at TP 1, 1280 at TP 2; the real rows draw the same numbers, the padding is zero
    # and masked, so weights, logits of real ids and loss agree, and the padding takes no gradient
    from pretrain.model import build_local_model, full_state_dict

    torch.manual_seed(7)
    model = build_local_model(TINY_IDS)  # TP 1 in this process
    for name in ("embed.weight", "lm_head.weight"):  # the model's rows: padded, the padding zero
        rows = dict(model.named_parameters())[name]
        assert rows.shape[0] == 1152 and not rows[1100:].any()
    w1 = full_state_dict(model)
    loss1, logits1, padding_grad1 = _padded_step(model)
    (w2, loss2, logits2, padding_grad2), _ = run_distributed(_start, 2, 2)
    assert w1.keys() == w2.keys()
    for name in w1:  # the full state: the token rows only, whatever the TP
        assert torch.equal(w1[name], w2[name]), name
    assert w1["embed.weight"].shape[0] == w2["lm_head.weight"].shape[0] == 1100
    torch.testing.assert_close(loss1, loss2)
    torch.testing.assert_close(logits1[..., :1100], logits2[..., :1100])
    assert (logits1[..., 1100:] == torch.finfo(torch.float32).min).all()
    assert (logits2[..., 1100:] == torch.finfo(torch.float32).min).all()
    assert padding_grad1 == padding_grad2 == 0


def layout_report(dims, seed: int) -> dict:
    """Called in each of 4 processes right after `init_distributed(tensor=2, seed=seed)` returned `dims`
    (by tests/test_tensor_parallel.py, whose TP=2 x DP=2 run this shares: one spawn of 4 processes)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from pretrain.distributed.parallel import deepspeed_mpu

    mpu = deepspeed_mpu()
    default_draw = torch.rand(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(seed)
    torch.rand(3)
    return {
        "dims": (dims.world, dims.rank, dims.tp, dims.dp, dims.tp_rank, dims.dp_rank, str(dims.device)),
        "tp_group": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
        "dp_ranks": mpu.get_data_parallel_group_ranks(),
        "mpu": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        "default": default_draw,
        "tp": tp_draw,
        # forking must not consume the default stream: the draw after equals the 2nd draw of the seed
        "after_fork_ok": torch.equal(after_fork, torch.rand(3)),
    }


def assert_tp2_dp2_layout(out: list[dict]) -> None:
    """The 4 ranks' `layout_report`s: TP groups of consecutive ranks, DP across them, RNG streams."""
    assert [o["dims"] for o in out] == [
        (4, 0, 2, 2, 0, 0, "cpu"), (4, 1, 2, 2, 1, 0, "cpu"), (4, 2, 2, 2, 0, 1, "cpu"), (4, 3, 2, 2, 1, 1, "cpu")
    ]
    assert [o["tp_group"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["dp_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["mpu"] for o in out] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    # default stream: identical everywhere (identical CPU-initialised weights)
    assert all(torch.equal(o["default"], out[0]["default"]) for o in out)
    # TP-region stream: differs across TP ranks, agrees across DP replicas of the same TP rank
    assert not torch.equal(out[0]["tp"], out[1]["tp"])
    assert torch.equal(out[0]["tp"], out[2]["tp"]) and torch.equal(out[1]["tp"], out[3]["tp"])
    assert not torch.equal(out[0]["tp"], out[0]["default"])
    assert all(o["after_fork_ok"] for o in out)


def test_init_distributed_rejects_world_not_multiple_of_tp(monkeypatch):
    from pretrain.distributed.parallel import init_distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    # a user's mistake (one line, exit 2 on every rank), not a ValueError's traceback
    with pytest.raises(UsageError, match=r"parallel.tensor \(2\) must divide the world size \(3\); launch"):
        init_distributed(ParallelConfig(tensor=2), seed=0)  # raises before joining any process group


def _train_tiny(rank: int, world: int, run_dir: str, shards, config: str = "configs/tiny.yaml",
                extra: tuple[str, ...] = ()) -> int:
    from pretrain.core.config import Config, load_config
    from pretrain.train import train

    return train(load_config(Config, config, [
        f"run.dir={run_dir}", "train.steps=4", "checkpoint.every=4", "eval.every=0", "log.every=2",
        f"data.train={shards.train}", f"data.tokenizer={shards.tokenizer}", "data.workers=0", *extra]))


def test_reshard_writes_the_universal_checkpoint_of_the_latest(shards, tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    assert run_distributed(_train_tiny, 1, str(run), shards) == [0]
    cli = [sys.executable, "-m", "pretrain.reshard", "--run", str(run), "--workers", "2"]
    done = subprocess.run(cli, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    universal = run / "checkpoints" / "step_4_universal"
    # the path alone on stdout, our progress lines on stderr, none of DeepSpeed's converter prints or bars (DEBUG)
    assert done.stdout == f"{universal}\n" and "reshard step_4" in done.stderr  # progress
    assert "Universal" not in done.stderr and "\r" not in done.stderr, done.stderr
    # every parameter in full TP-1 shape equals the weights DeepSpeed saved (fp32 run: module = master)
    module = torch.load(run / "checkpoints" / "step_4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    params = {k: v for k, v in module.items() if not k.endswith("_extra_state")}
    assert {p.name for p in (universal / "zero").iterdir()} >= set(params)
    for name, value in params.items():
        if name in ("embed.weight", "lm_head.weight"):
            value = value[:1100]  # the universal checkpoint keeps the token rows; each TP pads them anew
        torch.testing.assert_close(torch.load(universal / "zero" / name / "fp32.pt", weights_only=False)["param"],
                                   value, rtol=0, atol=0, msg=name)
    again = subprocess.run(cli, capture_output=True, text=True)
    assert again.returncode == 0 and "exists already" in again.stderr
    missing = subprocess.run([*cli[:4], str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.strip().endswith("no checkpoints/ in it")


# configs/small.yaml's recipe (the size configs' shared one: optimizer, bf16, ZeRO, clipping) at tiny dimensions
SMALL_RECIPE = ("model.d_model=64", "model.d_ff=128", "model.num_heads=4", "model.d_kv=16", "model.num_layers=2",
                "model.num_decoder_layers=2", "model.max_length=64", "data.input_length=64", "train.micro_batch=2",
                "train.global_batch=8", "parallel.backend=gloo", "log.every=1")


def test_the_shipped_recipe_continues_on_another_layout(shards, tmp_path):
    """A run of the size configs' recipe at DP 2 continues at DP 1 (converted inside the job) and at TP 2 (converted
    by pretrain.reshard): the universal conversion finds the optimizer's states (a recipe whose states it cannot
    read, as Adafactor's, fails here with KeyError: 'exp_avg')."""
    import shutil
    import subprocess
    import sys

    from tests.test_metrics import read_metrics

    run = tmp_path / "dp2"
    assert run_distributed(_train_tiny, 2, str(run), shards, "configs/small.yaml", SMALL_RECIPE) == [0, 0]
    resume = (*SMALL_RECIPE, f"checkpoint.resume={run}/checkpoints/step_4", "train.steps=6")
    assert run_distributed(_train_tiny, 1, str(tmp_path / "dp1"), shards, "configs/small.yaml", resume) == [0]
    universal = run / "checkpoints" / "step_4_universal"
    assert (universal / "zero").is_dir()  # the job converted it
    shutil.rmtree(universal)
    done = subprocess.run([sys.executable, "-m", "pretrain.reshard", "--run", str(run), "--workers", "1"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert run_distributed(_train_tiny, 2, str(tmp_path / "tp2"), shards, "configs/small.yaml",
                           (*resume, "parallel.tensor=2")) == [0, 0]
    for name in ("dp1", "tp2"):
        rows = read_metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [5, 6] and all(math.isfinite(r["loss"]) for r in rows), name


class HostAllocations(TorchDispatchMode):
    """The largest CPU tensor any torch op creates while active (factory functions included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("encoder, decoder, per_head", [
    ("vanilla", "vanilla", False),
    # every Synthesizer mixer, in mixtures weighted per head and per layer: an N x N matrix drawn on the host
    # would be 64 MiB of xxl's CPU memory per layer
    ("random+factorized_random+dense+factorized_dense+vanilla", "fixed_random+vanilla", True),
    ("random+factorized_random+dense+factorized_dense+vanilla", "fixed_random+vanilla", False),
])
def test_building_on_the_device_puts_nothing_of_the_model_on_the_host(encoder, decoder, per_head):
    # the trainer builds on its GPU (device=dims.device); on `meta` every tensor that would land on the host
    # instead is seen: xxl at its TP 8 (1.4 B parameters per shard, 44 GB of fp32 for the full model) must not
    # draw one parameter, nor a shard of one, on the CPU
    from pretrain.core.config import Config, load_config
    from pretrain.model import build_model
    from pretrain.planning.memory import tp_shapes

    cfg = load_config(Config, "configs/xxl.yaml", ["model.vocab_size=32100", f"model.encoder_attention={encoder}",
                                                    f"model.decoder_attention={decoder}",
                                                    f"model.mixture_per_head={per_head}"]).model
    with tp_shapes(8), HostAllocations() as host:
        model = build_model(cfg, activation_checkpointing="full", device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 1e9
    # at most one bookkeeping scalar: the smallest parameter, a per-layer mixture weight [2], is 8 bytes
    assert host.largest < 8, host.largest
