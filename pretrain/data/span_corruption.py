"""T5's span-corruption objective for one chunk of token ids, vectorised with numpy.

Follows `random_spans_helper`, `random_spans_noise_mask` and `noise_span_to_unique_sentinel` in
google-research/text-to-text-transfer-transformer `t5/data/preprocessors.py`. Rounding is
round-half-even, as `tf.round` and Python's `round` do (70 raw tokens -> 10 noise tokens, not 11).
"""
from __future__ import annotations

import numpy as np

from pretrain.core.config import MIN_INPUT_LENGTH


def _noise_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a chunk of `length` tokens: at least one of each and one kept token, as
    `random_spans_noise_mask` clamps them (the lengths below and the masks drawn must agree: with long spans,
    round(noise / mean) is 0 and the mask still has one span)."""
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    return num_noise, max(int(round(num_noise / mean_noise_span_length)), 1)


def _lengths_for(raw_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(inputs, targets) lengths, each with its EOS, of a corrupted chunk of `raw_length` tokens."""
    num_noise, num_spans = _noise_counts(raw_length, noise_density, mean_noise_span_length)
    return raw_length - num_noise + num_spans + 1, num_noise + num_spans + 1


def input_and_target_lengths(
    input_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """(raw_tokens_length, targets_length): the longest raw chunk whose corrupted inputs fit `input_length`.

    512 -> (568, 114), as T5's `random_spans_helper`.
    """
    if input_length < MIN_INPUT_LENGTH:
        raise ValueError(f"input_length ({input_length}) must be at least {MIN_INPUT_LENGTH}: a chunk of 2 tokens, "
                         "one of them noise, corrupts to a kept token, a sentinel and EOS")
    if not 0 < noise_density < 1 or not mean_noise_span_length >= 1:  # also NaN
        raise ValueError(f"noise_density ({noise_density}) must be in (0, 1) and mean_noise_span_length "
                         f"({mean_noise_span_length}) at least 1")
    # inputs(raw) >= raw (1 - density) + 0.5, so no raw length beyond `limit` fits: the search ends (at density
    # >= 1 the inputs would shrink as raw grows, and an unbounded search never did)
    limit = int(input_length / (1 - noise_density)) + 2
    raw_length = input_length - 1
    while raw_length < limit and _lengths_for(raw_length + 1, noise_density, mean_noise_span_length)[0] <= input_length:
        raw_length += 1
    targets_length = _lengths_for(raw_length, noise_density, mean_noise_span_length)[1]
    # T5's "minor hack": at density 0.5 keep targets no longer than inputs
    if noise_density == 0.5 and targets_length > input_length:
        raw_length -= 1
        targets_length -= 1
    return raw_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator, rows: int) -> np.ndarray:
    """[rows, num_segments]: each row splits `num_items` into non-empty parts, uniformly over all such splits."""
    if num_segments == 1:
        return np.full((rows, 1), num_items, dtype=np.int64)
    # a uniformly random (num_segments - 1)-subset of the num_items - 1 gaps marks where segments start:
    # the gaps holding the smallest of i.i.d. uniform keys
    keys = rng.random((rows, num_items - 1))
    edges = np.empty((rows, num_segments + 1), dtype=np.int64)
    edges[:, 0], edges[:, -1] = 0, num_items
    edges[:, 1:-1] = np.sort(np.argpartition(keys, num_segments - 2, axis=1)[:, : num_segments - 1], axis=1) + 1
    return np.diff(edges, axis=1)


def noise_span_lengths(
    length: int, rng: np.random.Generator, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
    rows: int = 1,
) -> np.ndarray:
    """[rows, 2 * spans] interleaved run lengths [non-noise 0, noise 0, non-noise 1, ...]: the noise masks' runs."""
    num_noise, num_spans = _noise_counts(length, noise_density, mean_noise_span_length)
    lengths = np.empty((rows, 2 * num_spans), dtype=np.int64)
    lengths[:, 0::2] = _random_segmentation(length - num_noise, num_spans, rng, rows)
    lengths[:, 1::2] = _random_segmentation(num_noise, num_spans, rng, rows)
    return lengths


def span_corrupt(
    tokens: np.ndarray,
    rng: np.random.Generator,
    *,
    vocab_size: int,
    eos_id: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) for one raw chunk [length], or for many at once [n, length] -> [n, ...].

    inputs:  non-noise tokens, each noise span replaced by one sentinel, then EOS.
    targets: <extra_id_0> span 0 <extra_id_1> span 1 ... EOS; sentinel i is id vocab_size - 1 - i.
    Every chunk of one length has the same number of noise tokens and spans, hence the same output lengths,
    which is what lets a whole block be corrupted with a few array operations.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim not in (1, 2):
        raise ValueError(f"span_corrupt takes a chunk [length] or chunks [n, length], got shape {tokens.shape}")
    chunks = tokens.reshape(-1, tokens.shape[-1])  # [n, length]
    rows, length = chunks.shape
    if length < 2:
        raise ValueError(f"a chunk to corrupt needs at least 2 tokens, got {length}")
    spans = noise_span_lengths(length, rng, noise_density, mean_noise_span_length, rows)  # [n, 2 * spans]
    first = np.zeros((rows, length), dtype=bool)  # the first token of each run
    np.put_along_axis(first, np.cumsum(spans, axis=1) - spans, True, axis=1)
    run = np.cumsum(first, axis=1) - 1  # [n, length]: even runs are kept, odd runs are noise
    is_noise = (run & 1).astype(bool)
    sentinel = (vocab_size - 1 - (run >> 1)).astype(tokens.dtype)  # span i's sentinel, on its tokens

    # inputs keep non-noise tokens and the first token of each noise span, which becomes its sentinel;
    # targets keep noise tokens and the first token of each kept span, which becomes the next span's sentinel
    kept_inputs = np.where(is_noise, sentinel, chunks)[~is_noise | first].reshape(rows, -1)
    kept_targets = np.where(is_noise, chunks, sentinel)[is_noise | first].reshape(rows, -1)
    inputs = np.empty((rows, kept_inputs.shape[1] + 1), dtype=tokens.dtype)
    inputs[:, :-1], inputs[:, -1] = kept_inputs, eos_id
    targets = np.empty((rows, kept_targets.shape[1] + 1), dtype=tokens.dtype)
    targets[:, :-1], targets[:, -1] = kept_targets, eos_id
    return (inputs[0], targets[0]) if tokens.ndim == 1 else (inputs, targets)
