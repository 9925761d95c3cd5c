"""What one training step costs besides compute, through the real engine with the shipped size-config recipe
(bf16, ZeRO 1, fused AdamW in two groups) at tiny dimensions, 2 gloo ranks, a few steps: its collectives against
the planner's estimate (pretrain.comm), and its host synchronisations."""
from __future__ import annotations

import pytest

from tests.distributed import run_distributed

COUNTED = ("all_reduce", "reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "broadcast")
TINY = ["model.vocab_size=1100", "model.d_model=64", "model.d_ff=128", "model.num_heads=4", "model.num_layers=2",
        "model.num_decoder_layers=2", "model.max_length=64", "data.input_length=64", "train.micro_batch=2",
        "train.global_batch=4"]
STEPS = 2


def _count_collectives(rank: int, world: int, steps: int, overrides: list[str]) -> dict:
    """(op, bytes) of every torch.distributed collective during `steps` training steps after a first one."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls: list[tuple[str, int]] = []
    counting = [False]

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            # the input: all_gather_into_tensor(output, input), the others take one tensor (or a list, then it)
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensor = kwargs.get("input_tensor", tensors[-1] if name == "all_gather_into_tensor" else tensors[0])
            if counting[0]:
                calls.append((name, tensor.numel() * tensor.element_size()))
            return fn(*args, **kwargs)
        return wrapper

    # before DeepSpeed starts: its backend keeps references to some of these functions
    for name in COUNTED:
        wrapped = counted(name, getattr(dist, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)

    from pretrain.config import Config, load_config
    from torch.utils._python_dispatch import TorchDispatchMode

    from pretrain.engine import build_engine
    from pretrain.faults import PreemptionFlag
    from pretrain.loop import train_step
    from pretrain.model import build_model
    from pretrain.parallel import init_distributed

    cfg = load_config(Config, "configs/small.yaml", overrides)
    dims = init_distributed(cfg.parallel, seed=1)
    model = build_model(cfg.model)
    engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp)
    generator = torch.Generator().manual_seed(rank)

    def batches():
        while True:
            ids = torch.randint(2, 1000, (cfg.train.micro_batch, 16), generator=generator)
            yield dict(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :6],
                       labels=ids[:, 1:7])

    class HostSyncs(TorchDispatchMode):
        """aten._local_scalar_dense: what .item(), bool(tensor), .tolist() and float(tensor) wait on."""

        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostSyncs.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    stream, preemption = batches(), PreemptionFlag()
    train_step(engine, stream, 1, dims)  # the first step allocates; counted from the second
    counting[0] = True
    with HostSyncs():
        for _ in range(steps):  # what pretrain.loop.run_loop does between log steps
            result = train_step(engine, stream, 1, dims, preemption)
            assert result.applied and not result.preempted
    counting[0] = False
    return {"calls": calls, "num_params": sum(p.numel() for p in model.parameters()), "syncs": HostSyncs.count}


@pytest.fixture(scope="module", params=[1, 2])
def counted(request) -> tuple[int, list[dict]]:
    """(ZeRO stage, per-rank counts of STEPS steps); ZeRO 2 with buckets of 200k elements."""
    overrides = [*TINY, f"zero.stage={request.param}", "zero.reduce_bucket_size=200000"]
    return request.param, run_distributed(_count_collectives, 2, STEPS, overrides)


def test_collectives_per_step_are_the_planners(counted):
    """bf16 at ZeRO 1 (BF16_Optimizer): per step one bucketed fp32 all-reduce of all gradients and one bf16
    all-gather of the weights per parameter group (one call each here: far under the bucket sizes), not one per
    parameter, with
    the bytes pretrain.comm assumes (within 1%: DeepSpeed pads the flat partitions for alignment); besides
    them DeepSpeed's scalars and the loop's one all-reduce of two numbers (the loss and the preemption flag)."""
    from pretrain.comm import estimate_comm
    from pretrain.config import Config, load_config

    stage, results = counted
    steps, overrides = STEPS, [*TINY, f"zero.stage={stage}", "zero.reduce_bucket_size=200000"]
    cfg = load_config(Config, "configs/small.yaml", overrides)
    assert cfg.precision == "bf16" and load_config(Config, "configs/small.yaml").zero.stage == 1  # as shipped
    for result in results:
        calls, num_params = result["calls"], result["num_params"]
        est = estimate_comm(cfg, 1, 2, 2, 1, 6, num_params, 1.0, gpus_per_node=8)
        expected = {c.name: c for c in est.collectives}
        assert set(expected) == {"gradients", "weights"}
        per_step = len(calls) // steps
        assert calls == calls[:per_step] * steps  # the same collectives every step
        step = calls[:per_step]
        gradients = [nbytes for op, nbytes in step if op == "all_reduce" and nbytes > 64]
        weights = [nbytes for op, nbytes in step if op == "all_gather_into_tensor"]  # each rank's partition
        assert len(gradients) == expected["gradients"].calls == (1 if stage == 1 else 4), step
        assert len(weights) == expected["weights"].calls == 2, step  # one per parameter group
        assert abs(sum(gradients) - expected["gradients"].nbytes) <= 0.01 * expected["gradients"].nbytes
        assert abs(2 * sum(weights) - expected["weights"].nbytes) <= 0.01 * expected["weights"].nbytes
        # the rest are scalars (the loss, the optimizer's norm and overflow checks): a few, not one per parameter
        rest = [call for call in step if call[1] <= 64]
        assert len(rest) + len(gradients) + len(weights) == len(step) and len(rest) <= 7, step
        # the loop's own: one all-reduce of [loss, preemption flag], not one each
        assert rest.count(("all_reduce", 8)) == 1, step


def test_host_syncs_per_step(counted):
    """As shipped (ZeRO 1, BF16_Optimizer), per step: the step-skip agreement (DeepSpeed's check of the gradient
    norm), which the preemption flag, copied to the host beside it, rides on; nothing else waits for the device
    (the preemption check's own all-reduce and .item() made it 2; DeepSpeed's clipping branched on the norm: a
    third, pretrain.engine clips on the device). ZeRO 2, not shipped, keeps DeepSpeed's own: 4 per step."""
    stage, results = counted
    per_step = {1: 1, 2: 4}[stage]
    assert [result["syncs"] for result in results] == [per_step * STEPS] * 2


def test_planner_prints_the_exposed_share(capsys):
    """xl at 4 x 8: ZeRO 1 leaves the gradient all-reduce and the all-gather exposed (44% of the step at the
    default links); ZeRO 2 overlaps the gradients with the backward; a slower network raises the share."""
    from pretrain.plan import main

    def exposed(*args: str) -> str:
        assert main(["--config", "configs/xl.yaml", "--nodes", "4", *args]) == 0
        return capsys.readouterr().out.strip().splitlines()[-2].rsplit("(", 1)[1]

    assert exposed() == "44% exposed)"
    assert exposed("zero.stage=2") == "14% exposed)"
    assert exposed("--link-gbps", "100") == "76% exposed)"
    assert main(["--config", "configs/xl.yaml", "--link-gbps", "0"]) == 2
    assert capsys.readouterr().err == "pretrain.plan: --link-gbps, --nvlink-gbps and --gpu-tflops must be > 0\n"
