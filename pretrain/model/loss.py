"""The training loss: the label it skips (`IGNORE_INDEX`, which the data collators write on padding) and
vocab-parallel cross-entropy (megatron's algorithm and backward) that keeps subnormal floats out of the softmax
and its gradient, and leaves the logits it is given intact.

Why: with T5 v1.1's LM-head init the logits have a standard deviation of about sqrt(d_model) (~22 for
T5-small), so 28% of a 32k softmax lies below float32's smallest normal number (1.2e-38). x86 CPUs run
every operation on a subnormal operand through a slow microcode path: the exp, the normalisation, and above
all the two LM-head backward GEMMs ([tokens, V] x [V, d] and its transpose) ran 20 to 100x slower than on
normal numbers and took 60% of a T5-small train step. `torch.set_flush_denormal` cannot fix it from a
library: it sets only the calling thread's FPU mode, not that of the intra-op worker threads.

So logits more than 50 below the row's maximum are raised to max - 50 before the exp: probabilities under
e^-50 / sum (< 2e-22) become that value. The loss changes by less than V e^-50 relative (invisible in
float32), each logit gradient by less than 2e-22 of the output gradient, and every probability times any
output gradient above 1e-8 stays a normal float.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility

IGNORE_INDEX = -100  # the label of a target position the loss skips (padding): torch's and HF's default
_FLOOR = -50.0  # log-probability floor relative to the row maximum, before normalisation


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    if group is not None:  # None: the vocabulary is not sharded
        dist.all_reduce(t, op=op, group=group)


class _FlooredVocabParallelCrossEntropy(_VocabParallelCrossEntropy):
    """Forward as megatron's with the floor (out of place) over the vocabulary sharded across `group` (None: not
    sharded, no collective); backward inherited from megatron's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
        # amax, not max: max also computes the indices (29 vs 4 ms over T5-small's [4, 114, 32128] on one thread)
        logits_max = logits.amax(dim=-1).to(torch.promote_types(logits.dtype, torch.float32))  # [b, m]
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        shifted = torch.sub(logits, logits_max[..., None])  # [b, m, V/tp] >= fp32, a new tensor
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.shape[-1], 0 if group is None else group.rank(), 1 if group is None else group.size(),
        )
        target_mask = (target < start) | (target >= end)  # [b, m]: the label lives on another rank
        masked_target = (target - start).masked_fill(target_mask, 0)
        # the label's logit is taken before the floor: a very unlikely label keeps its true (large) loss
        predicted = shifted.gather(-1, masked_target[..., None])[..., 0].masked_fill(target_mask, 0.0)
        softmax = shifted.clamp_(min=_FLOOR).exp_()
        sum_exp = softmax.sum(dim=-1)  # [b, m]
        _all_reduce(predicted, group)
        _all_reduce(sum_exp, group)
        softmax.div_(sum_exp[..., None])
        # megatron's backward reads these: grad = (softmax - onehot(label)) * grad_output, in place
        ctx.label_smoothing, ctx.vocab_size = 0.0, logits.shape[-1]
        ctx.save_for_backward(softmax, target_mask, masked_target.view(-1))
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return *_VocabParallelCrossEntropy.backward(ctx, grad_output)[:2], None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token loss [b, m] (fp32) of logits [b, m, V/tp] sharded over `tp_group` (the model's; None: one
    unsharded [b, m, V]) against global label ids [b, m]."""
    return _FlooredVocabParallelCrossEntropy.apply(logits, labels, tp_group)
