"""Greedy decoding for the evaluation jobs: incremental (per-layer caches of self-attention keys/values and
of the projected encoder output) or by full recomputation, which give the same tokens.

Works at any TP: every TP rank runs the same loop and the argmax is taken over the sharded vocabulary. Under
ZeRO-3 every forward gathers parameters from all DP ranks, so DP ranks must run the same number of forwards:
given their `group`, the ranks stop decoding together, when every rank's rows are finished.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.model.t5 import T5Model, vocab_parallel_argmax

DECODER_START_ID = 0  # T5 starts decoding from the pad id
PAD_ID = 0


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU; zeros of its shape for a meta tensor (a dry run on the meta device has shapes, no values)."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.cpu()


@torch.no_grad()
def generate_greedy(model: T5Model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_id: int = 1, use_cache: bool = True, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Generated ids [b, <= max_new_tokens] (no start token); after a row's EOS its ids are pad (0). With `group`
    (every rank of it calls together), all its ranks run the same number of decoding steps."""
    if model.training:
        raise ValueError("generate_greedy needs model.eval() (dropout would make decoding random)")
    memory = model.encode(input_ids, attention_mask)  # [b, n, d]
    b = input_ids.shape[0]
    ids = torch.full((b, 1), DECODER_START_ID, dtype=torch.long, device=input_ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    caches = [{} for _ in model.decoder.layers] if use_cache else None
    for _ in range(max_new_tokens):
        if use_cache:
            logits = model.decode(ids[:, -1:], memory, attention_mask, caches=caches)  # [b, 1, V/tp]
        else:
            logits = model.decode(ids, memory, attention_mask)[:, -1:]  # [b, 1, V/tp]
        nxt = vocab_parallel_argmax(logits, model.tp_group)[:, 0].masked_fill(done, PAD_ID)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        done |= nxt == eos_id
        finished = done.all().int()
        if group is not None:
            dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=group)  # finished only when all ranks are
        if bool(to_host(finished)):
            break
    return ids[:, 1:]
