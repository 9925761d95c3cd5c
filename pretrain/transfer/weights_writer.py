"""Safetensors weights written one tensor at a time, so an export never holds the model's weights in host memory.

safetensors' `save_file` takes every tensor of a file at once and serialises them into one buffer (the file in
memory besides the tensors). The format is a little-endian u64 header length, a JSON header (each tensor's
dtype, shape and byte offsets) and the tensors' bytes back to back: here the header is written first from the
shapes alone, then each tensor's bytes are appended as it is made. The split into
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` is huggingface_hub's, the layout HF's
`save_pretrained` writes; `safetensors.safe_open`, `from_pretrained` and `pretrain.model.pretrained` read it.
"""
from __future__ import annotations

import json
import struct
import sys
from collections import deque
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from pretrain.model.pretrained import EXPORT_MARK, INDEX

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class WeightsWriter:
    """`layout`: every tensor's name -> a tensor of its shape and dtype (on the meta device is enough), in the
    order `write` will be given them; the files' headers (and the index, when sharded) are written at once."""

    def __init__(self, folder: Path, layout: dict[str, torch.Tensor], max_shard_size: int | str) -> None:
        assert sys.byteorder == "little"  # safetensors stores little-endian bytes, as the tensors hold them
        meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in layout.items()}
        split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)
        self.folder, self.layout, self.file_of = folder, meta, split.tensor_to_filename
        self.pending = {file: deque(names) for file, names in split.filename_to_tensors.items()}
        for file, names in split.filename_to_tensors.items():
            (folder / file).write_bytes(_header({name: meta[name] for name in names}))
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor` (CPU, the layout's shape and dtype) to its file."""
        file, expected = self.file_of[name], self.layout[name]
        assert self.pending[file].popleft() == name, f"{name} is out of the layout's order"
        assert (tensor.shape, tensor.dtype) == (expected.shape, expected.dtype), (name, tensor.shape, tensor.dtype)
        with (self.folder / file).open("ab") as f:
            f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy())  # the tensor's bytes, not a copy

    def close(self) -> list[Path]:
        """The files written; every tensor of the layout must have been."""
        missing = [name for names in self.pending.values() for name in names]
        assert not missing, f"tensors never written: {missing[:3]}"
        return [self.folder / file for file in self.pending]


def _header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The header of a safetensors file holding `tensors` back to back in this order."""
    entries, offset = {"__metadata__": {"format": "pt", **EXPORT_MARK}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # padded with spaces to 8 bytes, as safetensors does: the data stays aligned
    return struct.pack("<Q", len(text)) + text
