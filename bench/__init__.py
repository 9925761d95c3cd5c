"""Benchmarks (see README.md and docs/): each prints ratios against a baseline measured in the same run.

`pretrain` is imported first: it installs the filter for megatron's import-time warnings."""
import pretrain  # noqa: F401
