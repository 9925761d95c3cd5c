"""What every other part imports, and nothing of ours below it: the config dataclasses and their YAML/CLI
parsing (config, cli), DeepSpeed's config dict derived from them (deepspeed_config), one-line progress for long work (progress), the crc32 manifests that say which checkpoint
and export files are intact (manifest), credentials out of text (redact), and the signals a process's life turns on
(signals: preemption, parent death). Imports: no pretrain package."""
