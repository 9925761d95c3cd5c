"""Communication of one training step, estimated for the planner: the bytes each collective moves, how long
it takes at a stated link speed, and whether it runs under the compute (overlapped) or the step waits for it
(exposed), beside the compute time at an assumed MFU.

What DeepSpeed 0.19 and megatron-core do in a step (read from their source; tests/test_comm.py counts the DP
collectives through the real engine):
- ZeRO 0 and 1: after the last backward of the step, one all-reduce of every gradient over DP, in buckets of
  5e8 elements (`engine.allreduce_gradients` -> `buffered_allreduce_fallback`; bf16 at ZeRO 1 goes through
  `BF16_Optimizer`, which ignores `zero.overlap_comm` and `zero.reduce_bucket_size`), in the communication
  dtype (fp32 for bf16/fp16 at ZeRO >= 1, pretrain.core.deepspeed_config): exposed, nothing computes meanwhile.
- ZeRO 1 and 2: after the optimizer step each rank's updated partition of the weights is all-gathered (model
  dtype, buckets of `zero.allgather_bucket_size` per parameter group): exposed.
- ZeRO 2: every micro batch's backward all-reduces the gradients in buckets of `zero.reduce_bucket_size` (each
  rank then keeps its partition: `allreduce_and_scatter`, not a reduce-scatter), from the gradient hooks on a side
  stream overlapped with the rest of that backward when `zero.overlap_comm`; a gradient larger than a bucket
  alone. The shared embedding's gradient is complete when the backward ends: it and the last partial bucket are
  reduced after it (`independent_gradient_partition_epilogue`), exposed.
- ZeRO 3: weights all-gathered per layer in every forward and backward, gradients reduce-scattered, both
  prefetched/overlapped (counted as overlapped).
- TP (megatron, no sequence parallelism): an all-reduce of the activations [b, n, d_model] after each
  row-parallel layer in the forward (encoder layer 2: attention and MLP; decoder layer 3: + cross-attention; the
  two vocab-parallel embeddings), the same number of input-gradient all-reduces in the backward (+ the LM head's),
  the forward's again under full recompute: in line with the compute, exposed; within a node.

Time of a collective: ring algorithm, whose bus traffic per GPU is 2 (n-1)/n x bytes for an all-reduce and
(n-1)/n x bytes for an all-gather or reduce-scatter, at BUS_EFFICIENCY of the slowest link the group crosses.
Within a node that is NVLink. A DP group spanning nodes has gpus_per_node / TP ranks on each node; NCCL splits a
collective into one ring per rank there, each crossing to the next node through its own NIC, so the group's bus
bandwidth is that many NICs (8 x 400 Gb/s for TP 1 on a DGX H100: nccl-tests' ~370 GB/s multi-node all-reduce),
capped by NVLink; the TP ranks' concurrent DP groups use disjoint NICs.
"""
from __future__ import annotations

from dataclasses import dataclass

from pretrain.core.config import Config
from pretrain.planning.units import decimal_size

BUFFERED_ALLREDUCE_ELEMENTS = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE
BUS_EFFICIENCY = 0.8  # NCCL's measured bus bandwidth reaches ~80% of the nominal link (nccl-tests, large messages)
NVLINK_GBPS = 3600.0  # H100 SXM NVLink 4: 450 GB/s per direction per GPU
IB_GBPS = 400.0  # one NDR InfiniBand NIC per GPU (DGX H100: 8 x 400 Gb/s)
GPU_TFLOPS = 989.0  # H100 SXM dense bf16
MFU = 0.4  # model FLOPs utilisation assumed for the compute time (Megatron-LM reports 40-50% at these sizes)
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: `calls` of them, `nbytes` of tensor in all, over a group of `ranks`."""

    name: str
    op: str  # all_reduce | all_gather | reduce_scatter
    calls: int
    nbytes: int  # tensor bytes summed over the calls (the buffer each rank holds, not the wire traffic)
    ranks: int
    gbps: float  # nominal link speed the group crosses
    overlapped: bool

    @property
    def seconds(self) -> float:
        factor = 2 * (self.ranks - 1) / self.ranks if self.op == "all_reduce" else (self.ranks - 1) / self.ranks
        return factor * self.nbytes / (self.gbps * 1e9 / 8 * BUS_EFFICIENCY)


@dataclass(frozen=True)
class CommEstimate:
    collectives: tuple[Collective, ...]
    compute_s: float  # model FLOPs per GPU / (GPU_TFLOPS x MFU)

    @property
    def exposed_s(self) -> float:
        """Exposed collectives, plus whatever overlapped communication outlasts the backward (2/3 of compute)."""
        overlapped = sum(c.seconds for c in self.collectives if c.overlapped)
        return (sum(c.seconds for c in self.collectives if not c.overlapped)
                + max(0.0, overlapped - 2 / 3 * self.compute_s))

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_s / self.step_s


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate_comm(cfg: Config, tp: int, dp: int, micro_batch: int, accumulation: int, target_length: int,
                  num_params: int, flops_per_gpu: float, gpus_per_node: int, link_gbps: float = IB_GBPS,
                  nvlink_gbps: float = NVLINK_GBPS, gpu_tflops: float = GPU_TFLOPS,
                  embedding_params: int = 0) -> CommEstimate:
    """The collectives of one step for one GPU holding `num_params` (its TP shard, of which `embedding_params`
    in the shared input embedding), DP group of `dp` ranks."""
    stage, zero = cfg.zero.stage, cfg.zero
    model_bytes = _BYTES[cfg.precision]
    comm_bytes = 4 if stage > 0 else model_bytes  # pretrain.core.deepspeed_config: fp32 under ZeRO (accumulates there)
    spans_nodes = tp * dp > gpus_per_node  # TP is innermost (pretrain.distributed.parallel): a DP group's ranks are tp apart
    dp_gbps = min(nvlink_gbps, link_gbps * max(1, gpus_per_node // tp)) if spans_nodes else nvlink_gbps
    grads = num_params * comm_bytes
    found: list[Collective] = []
    if dp > 1:
        if stage <= 1:
            found.append(Collective("gradients", "all_reduce", _ceil_div(num_params, BUFFERED_ALLREDUCE_ELEMENTS),
                                    grads, dp, dp_gbps, overlapped=False))
        elif stage == 2:
            # gradients fill buckets in backward order and each full bucket is reduced while the backward goes on;
            # the shared embedding's gradient is complete only when the backward ends (the encoder uses it first),
            # so it and the last partial bucket (the first encoder layers) are reduced after it, in the epilogue
            rest = num_params - embedding_params
            buckets = _ceil_div(rest, zero.reduce_bucket_size)
            last = rest - (buckets - 1) * zero.reduce_bucket_size
            if buckets > 1:
                found.append(Collective("gradients", "all_reduce", (buckets - 1) * accumulation,
                                        (rest - last) * comm_bytes * accumulation, dp, dp_gbps,
                                        overlapped=zero.overlap_comm))
            calls = 1 + (embedding_params > zero.reduce_bucket_size)  # DeepSpeed reduces a larger one alone
            found.append(Collective("gradients, last", "all_reduce", calls * accumulation,
                                    (last + embedding_params) * comm_bytes * accumulation, dp, dp_gbps,
                                    overlapped=False))
        else:
            found.append(Collective("gradients", "reduce_scatter", _ceil_div(num_params, zero.reduce_bucket_size)
                                    * accumulation, grads * accumulation, dp, dp_gbps, overlapped=True))
        if stage in (1, 2):
            # per parameter group (pretrain.runtime.engine.param_groups: the matrices, and the vectors in one more call)
            found.append(Collective("weights", "all_gather", _ceil_div(num_params, zero.allgather_bucket_size) + 1,
                                    num_params * model_bytes, dp, dp_gbps, overlapped=False))
        if stage == 3:  # forward and backward gather every layer's weights, every micro batch
            found.append(Collective("weights", "all_gather", 0, 2 * accumulation * num_params * model_bytes, dp,
                                    dp_gbps, overlapped=True))
    if tp > 1:
        m = cfg.model
        encoder = micro_batch * cfg.data.input_length * m.d_model * model_bytes  # [b, n, d] one activation
        decoder = micro_batch * target_length * m.d_model * model_bytes  # [b, m, d]
        # row-parallel outputs per layer, + 1: encoder and decoder ids share one embedding call (T5Model._embed_pair)
        forward_calls = 2 * m.num_layers + 3 * m.num_decoder_layers + 1
        forward = (2 * m.num_layers + 1) * encoder + (3 * m.num_decoder_layers + 1) * decoder
        passes = 3 if cfg.train.activation_checkpointing == "full" else 2  # fwd, bwd (+ the recomputed fwd)
        found.append(Collective("activations (TP)", "all_reduce", accumulation * (passes * forward_calls + 1),
                                accumulation * (passes * forward + decoder), tp, nvlink_gbps, overlapped=False))
    return CommEstimate(tuple(found), flops_per_gpu / (gpu_tflops * 1e12 * MFU))


def describe(est: CommEstimate, link_gbps: float, nvlink_gbps: float, gpu_tflops: float) -> list[str]:
    """The planner's lines for `est`."""
    lines = [f"communication per step (links: inter-node {link_gbps:.0f} Gb/s per GPU, NVLink {nvlink_gbps:.0f} "
             f"Gb/s, used at {BUS_EFFICIENCY:.0%}; compute at {gpu_tflops:.0f} TFLOP/s x MFU {MFU:.0%}):"]
    for c in est.collectives:
        lines.append(f"  {c.name:18s} {c.op:14s} {c.calls:4d} calls {decimal_size(c.nbytes):>9} over {c.ranks:3d} "
                     f"ranks {c.seconds * 1e3:8.1f} ms  {'overlapped' if c.overlapped else 'exposed'}")
    lines.append(f"  compute {est.compute_s * 1e3:.1f} ms + exposed communication {est.exposed_s * 1e3:.1f} ms = "
                 f"step {est.step_s * 1e3:.1f} ms ({est.exposed_fraction:.0%} exposed)")
    return lines
