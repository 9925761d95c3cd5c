"""Process-group setup: validation messages; the TP x DP layout, RNG streams and mpu checks that the 4-process
TP=2 x DP=2 run of tests/test_tensor_parallel.py applies (one spawn for both)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import ModelConfig, ParallelConfig
from pretrain.parallel import check_parallel, padded_vocab_size


def test_padded_vocab_size():
    assert padded_vocab_size(32100, 1) == 32128
    assert padded_vocab_size(32100, 2) == 32256
    assert padded_vocab_size(1100, 1) == 1152
    assert padded_vocab_size(1152, 1) == 1152


@pytest.mark.parametrize(
    "changes, tp, world, needle",
    [
        ({}, 2, 3, "world size (3) must be a multiple of parallel.tensor (2)"),
        ({"num_heads": 6}, 4, 4, "model.num_heads (6) must be a multiple of parallel.tensor (4)"),
        ({"vocab_size": 1152}, 2, 2, "model.vocab_size (1152) must be a multiple of 128 x parallel.tensor (256); use 1280"),
    ],
)
def test_check_parallel_names_both_values(changes, tp, world, needle):
    cfg = dataclasses.replace(ModelConfig(vocab_size=32256, num_heads=8), **changes)
    with pytest.raises(ValueError) as e:
        check_parallel(cfg, tp, world)
    assert needle in str(e.value)
    check_parallel(ModelConfig(vocab_size=32256, num_heads=8), 2, 4)


def layout_report(dims, seed: int) -> dict:
    """Called in each of 4 processes right after `init_distributed(tensor=2, seed=seed)` returned `dims`
    (by tests/test_tensor_parallel.py, whose TP=2 x DP=2 run this shares: one spawn of 4 processes)."""
    import torch.distributed as dist

    from megatron.core import parallel_state, tensor_parallel

    from pretrain.parallel import deepspeed_mpu

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
    from pretrain.parallel import init_distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"world size \(3\) must be a multiple of parallel.tensor \(2\)"):
        init_distributed(ParallelConfig(tensor=2), seed=0)  # raises before joining any process group
