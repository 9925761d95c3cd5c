"""What every other part imports, and nothing of ours below it: the config dataclasses and their YAML/CLI
parsing (config, cli), one-line progress for long work (progress), the crc32 manifests that say which checkpoint
and export files are intact (manifest), and credentials out of text (redact). Imports: no pretrain package."""
