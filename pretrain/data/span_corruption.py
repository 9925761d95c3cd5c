"""T5's span-corruption objective for one chunk of token ids, vectorised with numpy.

Follows `random_spans_helper`, `random_spans_noise_mask` and `noise_span_to_unique_sentinel` in
google-research/text-to-text-transfer-transformer `t5/data/preprocessors.py`. Rounding is
round-half-even, as `tf.round` and Python's `round` do (70 raw tokens -> 10 noise tokens, not 11).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


def _lengths_for(raw_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(inputs, targets) lengths, each with its EOS, of a corrupted chunk of `raw_length` tokens."""
    num_noise = int(round(raw_length * noise_density))
    num_spans = int(round(num_noise / mean_noise_span_length))
    return raw_length - num_noise + num_spans + 1, num_noise + num_spans + 1


def input_and_target_lengths(
    input_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """(raw_tokens_length, targets_length): the longest raw chunk whose corrupted inputs fit `input_length`.

    512 -> (568, 114), as T5's `random_spans_helper`.
    """
    if input_length < 2:
        raise ValueError(f"input_length ({input_length}) must be at least 2")
    raw_length = input_length - 1
    while _lengths_for(raw_length + 1, noise_density, mean_noise_span_length)[0] <= input_length:
        raw_length += 1
    targets_length = _lengths_for(raw_length, noise_density, mean_noise_span_length)[1]
    # T5's "minor hack": at density 0.5 keep targets no longer than inputs
    if noise_density == 0.5 and targets_length > input_length:
        raw_length -= 1
        targets_length -= 1
    return raw_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Split `num_items` into `num_segments` non-empty parts, uniformly over all such splits."""
    # a uniformly random (num_segments - 1)-subset of the num_items - 1 gaps marks where segments start
    cuts = np.sort(rng.permutation(num_items - 1)[: num_segments - 1]) + 1
    edges = np.empty(num_segments + 1, dtype=np.int64)
    edges[0], edges[-1], edges[1:-1] = 0, num_items, cuts
    return np.diff(edges)


def noise_span_lengths(
    length: int, rng: np.random.Generator, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> np.ndarray:
    """Interleaved span lengths [non-noise 0, noise 0, non-noise 1, noise 1, ...]: the noise mask's runs."""
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
    lengths = np.empty(2 * num_spans, dtype=np.int64)
    lengths[0::2] = _random_segmentation(length - num_noise, num_spans, rng)
    lengths[1::2] = _random_segmentation(num_noise, num_spans, rng)
    return lengths


@lru_cache(maxsize=64)
def _alternating(num_spans: int) -> np.ndarray:
    """[False, True] * num_spans: the noise flag of each run (cached: np.tile costs as much as the rest)."""
    pattern = np.arange(2 * num_spans) % 2 == 1
    pattern.flags.writeable = False
    return pattern


def span_corrupt(
    tokens: np.ndarray,
    rng: np.random.Generator,
    *,
    vocab_size: int,
    eos_id: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) for one raw chunk, both ending with EOS.

    inputs:  non-noise tokens, each noise span replaced by one sentinel, then EOS.
    targets: <extra_id_0> span 0 <extra_id_1> span 1 ... EOS; sentinel i is id vocab_size - 1 - i.
    """
    tokens = np.asarray(tokens)
    length = len(tokens)
    if length < 2:
        raise ValueError(f"a chunk to corrupt needs at least 2 tokens, got {length}")
    spans = noise_span_lengths(length, rng, noise_density, mean_noise_span_length)
    starts = np.cumsum(spans) - spans  # start of each run; even runs are kept, odd runs are noise
    is_noise = np.repeat(_alternating(len(spans) // 2), spans)
    sentinels = (vocab_size - 1 - np.arange(len(spans) // 2)).astype(tokens.dtype)

    keep_in_inputs = ~is_noise
    keep_in_inputs[starts[1::2]] = True  # the first token of each noise span becomes its sentinel
    keep_in_targets = is_noise.copy()
    keep_in_targets[starts[0::2]] = True  # the first token of each kept span becomes a sentinel

    with_sentinels = tokens.copy()
    with_sentinels[starts[1::2]] = sentinels
    inputs = np.empty(int(keep_in_inputs.sum()) + 1, dtype=tokens.dtype)
    inputs[:-1], inputs[-1] = with_sentinels[keep_in_inputs], eos_id

    with_sentinels = tokens.copy()
    with_sentinels[starts[0::2]] = sentinels
    targets = np.empty(int(keep_in_targets.sum()) + 1, dtype=tokens.dtype)
    targets[:-1], targets[-1] = with_sentinels[keep_in_targets], eos_id
    return inputs, targets
