"""The training runtime that pretraining and fine-tuning share: the DeepSpeed engine (engine), the one
loop (loop), checkpoints that resume exactly (checkpoint), faults and exit codes (faults), the run lock (run_lock),
job set-up (jobs), LR schedules (schedule), metrics to JSONL/TensorBoard/W&B (metrics) and the pictures logged
with them (pictures). Imports: pretrain.core, pretrain.distributed, pretrain.model."""
