"""What a job will cost before it runs: memory per GPU (memory), communication per step (comm), a checkpoint's
bytes and save time (checkpoint), and the layout check every job and `python -m pretrain.plan` run (planner).
Imports: pretrain.core (the DeepSpeed config it plans for too), pretrain.distributed, pretrain.model, pretrain.data;
never pretrain.runtime, which runs after it (tests/test_layout.py)."""
