"""Process groups: TP x DP over megatron-core's parallel state and torch.distributed, the RNG
seeding per rank, the vocabulary padding TP needs (parallel). Imports: pretrain.core."""
