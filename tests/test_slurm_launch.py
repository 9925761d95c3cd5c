"""launch/ on a real SLURM (tests/slurm_cluster.py): 2 nodes x 2 processes joined into one gloo group by
`srun python` (one task per process) and by `srun torchrun --rdzv-backend c10d` (one task per node)."""
from __future__ import annotations

import json
from pathlib import Path

from pretrain.distributed.env import slurm_port
from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python")
TORCHRUN_STEP = (
    "srun --ntasks-per-node=1 {py} -m torch.distributed.run --nnodes=2 --nproc-per-node=2 "
    "--rdzv-backend=c10d --rdzv-id=$SLURM_JOB_ID "
    "--rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -1):$((30000 + SLURM_JOB_ID % 10000)) "
    "-m tests.launch_probe {out}"
)


def _records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_srun_python_and_srun_torchrun_form_one_group(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    srun_out, torchrun_out = tmp_path / "srun", tmp_path / "torchrun"
    srun_out.mkdir()
    torchrun_out.mkdir()
    common = ["--nodes=2", f"--output={tmp_path}/%j.out", "--export=ALL,OMP_NUM_THREADS=1"]
    jobs = {
        "srun": slurm_cluster.sbatch(*common, "--ntasks-per-node=2", "--wrap",
                                     f"srun {PY} -m tests.launch_probe {srun_out}", cwd=REPO),
        "torchrun": slurm_cluster.sbatch(*common, "--ntasks-per-node=1", "--cpus-per-task=2", "--wrap",
                                         TORCHRUN_STEP.format(py=PY, out=torchrun_out), cwd=REPO),
    }
    for name, job in jobs.items():
        info = slurm_cluster.wait(job)[0]
        assert info["JobState"] == "COMPLETED", (name, info, (tmp_path / f"{job}.out").read_text())

    for rec in _records(srun_out, 4):
        # srun places tasks in blocks: ranks 0,1 on node1 (SLURM_NODEID 0), ranks 2,3 on node2
        assert rec["source"] == "slurm"
        assert (rec["world_size"], rec["local_world_size"]) == (4, 2)
        assert (rec["local_rank"], rec["node"]) == (rec["rank"] % 2, str(rec["rank"] // 2))
        assert (rec["master_addr"], rec["master_port"]) == ("node1", slurm_port(jobs["srun"]))
        assert rec["gathered"] == [0, 1, 2, 3]
    records = _records(torchrun_out, 4)
    assert {rec["source"] for rec in records} == {"torchrun"}
    assert {(rec["world_size"], rec["local_world_size"]) for rec in records} == {(4, 2)}
    # one torchrun agent per node: each node hosts local ranks 0 and 1
    assert sorted((rec["node"], rec["local_rank"]) for rec in records) == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert all(rec["gathered"] == [0, 1, 2, 3] for rec in records)
