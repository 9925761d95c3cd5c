"""Tensor parallelism with real gloo process groups: for every mixer, the loss and every gradient (gathered
to full shape) at TP=2 (and TP=2 x DP=2) equal the unsharded TP=1 model from the same seed (in float64, within 1e-5 relative); greedy
decoding at TP=2 equals TP=1; TP shards merged by DeepSpeed's universal-checkpoint rules rebuild the
full parameters. The 4-process run also checks the TP x DP layout and RNG streams (tests/test_parallel.py). A built
model reads no global parallel state: it runs the same with megatron's TP state unset."""
from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
from megatron.core import parallel_state

from pretrain.core.config import ModelConfig, ParallelConfig
from pretrain.model import (
    build_local_model,
    build_model,
    full_state_dict,
    generate_greedy,
    load_full_state_dict,
    universal_checkpoint_info,
)
from tests.distributed import run_distributed
from tests.registry import assert_covers
from tests.test_parallel import assert_tp2_dp2_layout, layout_report

CFG = ModelConfig(vocab_size=256, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                  max_length=16, factorized_k=3, relative_attention_num_buckets=8, relative_attention_max_distance=16)
# (encoder, decoder, mixture_per_head, activation_checkpointing, position_bias): every mixer appears on both sides;
# true = full; every position_bias with a mixture of vanilla (where "vanilla" weighs the bias with Q K^T) and a
# stack without vanilla, and "none" with recompute (a core without bias or mask), and with the fused forms
VARIANTS = [
    ("vanilla", "vanilla", False, False, "all"),
    ("dense", "random", False, True, "all"),
    ("random", "dense", False, "selective", "all"),
    ("fixed_random", "factorized_dense", False, False, "all"),
    ("factorized_dense", "factorized_random", False, False, "all"),
    ("factorized_random", "fixed_random", False, False, "all"),
    ("random+vanilla", "dense+vanilla", False, False, "all"),
    ("random+dense+vanilla", "random+dense", True, False, "all"),
    ("random+vanilla", "dense", True, "selective", "vanilla"),
    ("random", "vanilla", False, "selective", "none"),
    ("vanilla", "random+vanilla", False, False, "none"),
    # fused forms (attention.py `_fused`) on the CPU's flash kernel: a per-head mixture of all three Q' K'^T mixers
    # with a padding mask, and dense with is_causal under selective recompute; greedy decoding through the cache
    ("factorized_random+dense+vanilla", "dense", True, "selective", "none"),
]


def test_the_variants_name_every_registered_mixer_in_each_stack():
    assert_covers([enc for enc, *_ in VARIANTS], "test_tensor_parallel.VARIANTS's encoders")
    assert_covers([dec for _, dec, *_ in VARIANTS], "test_tensor_parallel.VARIANTS's decoders")


def _cfg(enc: str, dec: str, per_head: bool, position_bias: str = "all") -> ModelConfig:
    return dataclasses.replace(CFG, encoder_attention=enc, decoder_attention=dec, mixture_per_head=per_head,
                               position_bias=position_bias)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (2, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    labels = torch.randint(2, 256, (2, 7), generator=g)
    labels[0, 5:] = -100
    dec = torch.cat([torch.zeros(2, 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    return ids, mask, dec, labels


def _step(model, seed: int):
    # float64: the comparison then checks the sharding logic, not fp32 summation order (a per-layer mixture
    # weight's gradient is a sum over heads that cancels to ~1e-3 of its terms)
    model.double()
    out = model(*_batch(seed)[:3], _batch(seed)[3])
    out.loss.backward()
    return out.loss.item(), full_state_dict(model, grads=True)


def _tp_worker(rank: int, world: int, variants) -> tuple[dict | None, list]:
    from pretrain.distributed.parallel import init_distributed

    dims = init_distributed(ParallelConfig(tensor=2, timeout_s=120), seed=0)
    layout = layout_report(dims, seed=0) if world == 4 else None
    results = []
    for enc, dec, per_head, ckpt, position_bias in variants:
        torch.manual_seed(0)
        model = build_model(_cfg(enc, dec, per_head, position_bias), activation_checkpointing=ckpt)
        loss, grads = _step(model, seed=dims.dp_rank)
        model.eval()
        ids, mask = _batch(dims.dp_rank)[:2]
        tokens = generate_greedy(model, ids, mask, max_new_tokens=6)
        shards = {n: p.detach().clone() for n, p in model.named_parameters()}
        results.append((loss, grads, tokens, shards, universal_checkpoint_info(model, 250)))
    return layout, results


def _reference(enc: str, dec: str, per_head: bool, position_bias: str, seed: int):
    torch.manual_seed(0)
    model = build_local_model(_cfg(enc, dec, per_head, position_bias))
    loss, grads = _step(model, seed)
    model.eval()
    ids, mask = _batch(seed)[:2]
    return loss, grads, generate_greedy(model, ids, mask, max_new_tokens=6), full_state_dict(model)


def _assert_equal_to_reference(result, ref) -> None:
    loss, grads, tokens = result[:3]
    ref_loss, ref_grads, ref_tokens = ref[:3]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].norm().clamp(min=1e-12)
        assert (g - ref_grads[name]).norm() / scale <= 1e-5, name
    assert torch.equal(tokens, ref_tokens)


def _merge_like_deepspeed(shards: list[dict], info: dict, name: str) -> torch.Tensor:
    """ds_to_universal's merge rules (deepspeed/checkpoint/ds_to_universal.py, merge_tp_slices)."""
    def matches(key: str) -> bool:
        return any(re.match(p, name) for p in info[key])

    slices = [s[name] for s in shards]
    if matches("tp_replicated_parameter_patterns"):
        assert all(torch.equal(slices[0], s) for s in slices[1:]), name
        param = slices[0]
    elif matches("parameter_with_2_sub_params_cat_dim_0"):
        chunks = [s.chunk(2, dim=0) for s in slices]
        param = torch.cat([torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])])
    else:
        param = torch.cat(slices, dim=1 if matches("parameter_with_row_parallelism_patterns") else 0)
    return param[: info["original_vocab_size"]] if matches("vocabulary_parameter_patterns") else param


def test_tp2_equals_tp1_for_every_mixer():
    out = [results for _, results in run_distributed(_tp_worker, 2, VARIANTS)]
    for i, (enc, dec, per_head, _, position_bias) in enumerate(VARIANTS):
        ref = _reference(enc, dec, per_head, position_bias, seed=0)
        for rank in range(2):
            _assert_equal_to_reference(out[rank][i], ref)
        info = out[0][i][4]
        shards = [out[0][i][3], out[1][i][3]]
        for name, full in ref[3].items():
            expected = full[:250] if name in ("embed.weight", "lm_head.weight") else full
            assert torch.equal(_merge_like_deepspeed(shards, info, name), expected), name


def test_tp2_dp2_layout_and_equality_to_tp1_per_data_shard():
    variant = ("random+vanilla", "dense+vanilla", False, False, "all")
    layouts, out = zip(*run_distributed(_tp_worker, 4, [variant]))
    assert_tp2_dp2_layout(list(layouts))
    for rank, dp_rank in zip(range(4), (0, 0, 1, 1)):  # ranks [0, 1] are DP rank 0, [2, 3] DP rank 1
        _assert_equal_to_reference(out[rank][0], _reference(*variant[:3], variant[4], seed=dp_rank))
    assert out[0][0][0] != out[2][0][0]  # the DP ranks did see different data


@contextlib.contextmanager
def _megatron_tp_state_unset():
    """megatron's global TP group, rank and size set to None: a read of any of them fails (megatron asserts that the
    group is set), while the model's own group stays live."""
    names = ("_TENSOR_MODEL_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK")
    saved = {name: getattr(parallel_state, name) for name in names}
    for name in names:
        setattr(parallel_state, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(parallel_state, name, value)


def _unset_state_worker(rank: int, world: int, variants) -> list:
    from pretrain.distributed.parallel import init_distributed

    init_distributed(ParallelConfig(tensor=2, timeout_s=120), seed=0)
    results = []
    for enc, dec, per_head, ckpt, position_bias in variants:
        for unset in (False, True):
            torch.manual_seed(0)
            model = build_model(_cfg(enc, dec, per_head, position_bias), activation_checkpointing=ckpt)
            with _megatron_tp_state_unset() if unset else contextlib.nullcontext():
                loss, grads = _step(model, seed=0)
                model.eval()
                ids, mask = _batch(0)[:2]
                tokens = generate_greedy(model, ids, mask, max_new_tokens=6)
                mixture = model.mixture_weights()
                load_full_state_dict(model, full_state_dict(model))
                results.append((loss, grads, tokens, mixture, full_state_dict(model)))
    return results


def test_the_model_reads_no_global_parallel_state_after_it_is_built():
    # the model keeps the TP group build_model gave it: its forward and backward (a shared and a per-head mixture
    # weight, selective recompute), greedy decoding, mixture weights and the full state dict in both directions
    # give the same at TP 2 with megatron's global TP state unset as with it set
    variants = [("random+dense+vanilla", "random+vanilla", True, "selective", "all"),
                ("dense+vanilla", "random+vanilla", False, False, "vanilla")]
    for results in run_distributed(_unset_state_worker, 2, variants):
        for with_state, without in zip(results[::2], results[1::2]):
            assert all(_equal(a, b) for a, b in zip(with_state, without))


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
