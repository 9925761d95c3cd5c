"""A job prints the project's lines: what the libraries say that no user can act on is silenced at the source,
in a fresh interpreter as a job starts (`import pretrain`), not by pytest's filters. The megatron advice on CUDA
streams is filtered in `pretrain.runtime.jobs.init_job` off CUDA (checked by hand: a 2-rank TP 2 tiny run prints
no line but INFO lines, docs/training.md)."""
from __future__ import annotations

import subprocess
import sys

PROBE = """
import logging, sys, warnings
import pretrain
# DeepSpeed's logger as deepspeed.utils.logging makes it: INFO, its own stdout handler, no propagation
ds = logging.getLogger("DeepSpeed")
ds.setLevel(logging.INFO)
ds.propagate = False
handler = logging.StreamHandler(sys.stdout)
handler.setLevel(logging.INFO)
ds.addHandler(handler)
ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
ds.info("Setting ds_accelerator to cuda (auto detect)")
ds.warning("a DeepSpeed warning that stays")
warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
              "`torch.distributed.all_gather_single` instead.", FutureWarning)
warnings.warn("a FutureWarning that stays", FutureWarning)
"""


def test_library_notices_nobody_can_act_on_are_silenced_at_the_source():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert done.stdout == "a DeepSpeed warning that stays\n"
    assert "FutureWarning: a FutureWarning that stays" in done.stderr and "all_gather_into_tensor" not in done.stderr
