"""From a scheduler's environment to a process group: rank/world/rendezvous (env.py), and torchrun on one machine (local.py)."""
