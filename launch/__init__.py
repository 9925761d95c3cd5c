"""From a scheduler's environment to a process group: rank/world/rendezvous and the tie to the launcher (env.py),
torchrun with the jobs' exit codes and signals (run.py), and it on one machine (local.py)."""
