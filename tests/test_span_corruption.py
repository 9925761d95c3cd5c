"""Span corruption against T5: lengths by the formula, noise statistics, sentinel order, reconstruction."""
import numpy as np
import pytest

from pretrain.data.span_corruption import input_and_target_lengths, span_corrupt

VOCAB = 32100


def t5_lengths(raw: int, density: float, mean: float) -> tuple[int, int]:
    """random_spans_helper's inner function, written out from the T5 reference text."""
    noise = round(raw * density)
    spans = round(noise / mean)
    return raw - noise + spans + 1, noise + spans + 1


def t5_noise_mask(length: int, rng: np.random.Generator, density: float, mean: float) -> np.ndarray:
    """A literal port of T5's random_spans_noise_mask (shuffle of a cut indicator, segment sums)."""
    num_noise = min(max(round(length * density), 1), length - 1)
    num_spans = max(round(num_noise / mean), 1)

    def segmentation(num_items, num_segments):
        first = np.concatenate([[0], rng.permutation((np.arange(num_items - 1) < num_segments - 1).astype(int))])
        return np.bincount(np.cumsum(first), minlength=num_segments)

    lengths = np.stack([segmentation(length - num_noise, num_spans), segmentation(num_noise, num_spans)], 1).reshape(-1)
    starts = np.cumsum(lengths)[:-1]
    indicator = np.zeros(length, int)
    indicator[starts] = 1
    return np.cumsum(indicator) % 2 == 1


def noise_mask_of(tokens: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Recover the noise mask: tokens (all distinct) missing from the inputs were noise."""
    return ~np.isin(tokens, inputs)


@pytest.mark.parametrize("input_length", [16, 64, 100, 128, 256, 512, 1024])
@pytest.mark.parametrize("density, mean", [(0.15, 3.0), (0.3, 5.0), (0.5, 3.0)])
def test_lengths_follow_the_t5_formula(input_length, density, mean):
    raw, targets = input_and_target_lengths(input_length, density, mean)
    # the largest raw length whose inputs fit, found by brute force
    fits = [t for t in range(1, 4 * input_length) if t5_lengths(t, density, mean)[0] <= input_length]
    expected_raw = max(fits)
    expected_targets = t5_lengths(expected_raw, density, mean)[1]
    if density == 0.5 and expected_targets > input_length:
        expected_raw, expected_targets = expected_raw - 1, expected_targets - 1
    assert (raw, targets) == (expected_raw, expected_targets)
    # and a corrupted chunk of that raw length has exactly those lengths
    inputs, tgt = span_corrupt(np.arange(3, 3 + raw), np.random.default_rng(0), vocab_size=VOCAB, eos_id=1,
                               noise_density=density, mean_noise_span_length=mean)
    if not (density == 0.5 and t5_lengths(raw + 1, density, mean)[1] > input_length):
        assert len(inputs) <= input_length and len(tgt) == targets


def test_known_values():
    assert input_and_target_lengths(512) == (568, 114)
    assert input_and_target_lengths(64) == (70, 14)  # round-half-even: 70 * 0.15 = 10.5 -> 10


@pytest.mark.parametrize("batched", [False, True])
def test_noise_density_and_mean_span_length_over_many_samples(batched):
    rng = np.random.default_rng(1)
    tokens = np.arange(3, 3 + 568)
    if batched:  # one call for all 2000 chunks, as the loader corrupts a whole shuffle block
        pairs = zip(*span_corrupt(np.tile(tokens, (2000, 1)), rng, vocab_size=VOCAB, eos_id=1))
    else:
        pairs = (span_corrupt(tokens, rng, vocab_size=VOCAB, eos_id=1) for _ in range(2000))
    noise, spans, position_rate = 0, 0, np.zeros(568)
    for inputs, targets in pairs:
        mask = noise_mask_of(tokens, inputs[:-1])
        mask[np.isin(tokens, targets[:-1])] = True  # first tokens of spans were replaced by a sentinel
        noise += mask.sum()
        spans += (targets >= VOCAB - 100).sum()
        position_rate += mask
    assert noise / (2000 * 568) == pytest.approx(85 / 568, abs=1e-12)  # round(568 * 0.15) = 85 every time
    assert noise / spans == pytest.approx(85 / 28)  # round(85 / 3) = 28 spans of mean length 3.04
    # the per-position noise rate matches a literal port of T5's mask generator
    ref_rng = np.random.default_rng(2)
    ref_rate = sum(t5_noise_mask(568, ref_rng, 0.15, 3.0).astype(float) for _ in range(2000))
    assert position_rate[0] == ref_rate[0] == 0  # spans start with non-noise
    assert position_rate[-1] == ref_rate[-1] == 2000  # and end with noise
    assert np.abs(position_rate - ref_rate).mean() / 2000 < 0.01
    assert np.abs(position_rate[20:-20] / 2000 - 0.15).max() < 0.05  # uniform away from the ends


def assert_t5_pair(tokens: np.ndarray, inputs: np.ndarray, targets: np.ndarray) -> None:
    """Sentinels count down from VOCAB - 1 in both, both end with EOS, and they rebuild `tokens`."""
    assert inputs[-1] == 1 and targets[-1] == 1
    in_sent = inputs[inputs >= VOCAB - 100]
    tg_sent = targets[targets >= VOCAB - 100]
    k = len(in_sent)
    assert k >= 1
    np.testing.assert_array_equal(in_sent, VOCAB - 1 - np.arange(k))  # <extra_id_0> = VOCAB - 1, counting down
    np.testing.assert_array_equal(tg_sent, VOCAB - 1 - np.arange(k))
    assert targets[0] == VOCAB - 1
    # fill each sentinel in the inputs with the target span that follows the same sentinel
    spans = np.split(targets[:-1], np.flatnonzero(targets[:-1] >= VOCAB - 100)[1:])
    filled = {int(s[0]): s[1:] for s in spans}
    rebuilt = np.concatenate([filled[int(t)] if t >= VOCAB - 100 else [t] for t in inputs[:-1]])
    np.testing.assert_array_equal(rebuilt, tokens)


def test_sentinel_order_and_reconstruction():
    rng = np.random.default_rng(3)
    for length in [2, 5, 70, 568, 1137]:
        tokens = rng.integers(3, VOCAB - 100, size=length)
        assert_t5_pair(tokens, *span_corrupt(tokens, rng, vocab_size=VOCAB, eos_id=1))


def test_many_chunks_in_one_call():
    rng = np.random.default_rng(4)
    for length in [2, 70, 568]:
        chunks = rng.integers(3, VOCAB - 100, size=(50, length)).astype(np.int32)
        inputs, targets = span_corrupt(chunks, rng, vocab_size=VOCAB, eos_id=1)
        lengths = t5_lengths(length, 0.15, 3.0) if length > 2 else (3, 3)  # at least one noise token
        assert inputs.shape == (50, lengths[0]) and targets.shape == (50, lengths[1])
        assert inputs.dtype == np.int32
        for row, i, t in zip(chunks, inputs, targets):
            assert_t5_pair(row, i, t)
    masks = {tuple(noise_mask_of(np.arange(568), i[:-1])) for i in  # rows draw independent masks
             span_corrupt(np.tile(np.arange(568), (50, 1)), rng, vocab_size=VOCAB, eos_id=1)[0]}
    assert len(masks) == 50
    with pytest.raises(ValueError, match="chunks"):
        span_corrupt(np.zeros((2, 3, 70), np.int32), rng, vocab_size=VOCAB, eos_id=1)


def test_deterministic_given_the_generator_and_bad_lengths():
    tokens = np.arange(3, 73, dtype=np.int32)
    a = span_corrupt(tokens, np.random.default_rng(7), vocab_size=1100, eos_id=1)
    b = span_corrupt(tokens, np.random.default_rng(7), vocab_size=1100, eos_id=1)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].dtype == np.int32
    with pytest.raises(ValueError, match="at least 2"):
        span_corrupt(tokens[:1], np.random.default_rng(0), vocab_size=1100, eos_id=1)
    with pytest.raises(ValueError, match="input_length"):
        input_and_target_lengths(1)


@pytest.mark.parametrize("density, mean", [(1.5, 3.0), (1.0, 3.0), (0.0, 3.0), (-0.1, 3.0), (0.15, 0.0), (0.15, 0.5)])
def test_lengths_refuse_what_no_raw_length_fits(density, mean):
    # density 1.5 made the search for the raw length loop forever (inputs shrink as raw grows); 0 or a negative
    # density, or spans shorter than a token, divided by zero or failed deep inside the corruption
    with pytest.raises(ValueError, match=r"noise_density \(.*\) must be in \(0, 1\) and mean_noise_span_length"):
        input_and_target_lengths(512, density, mean)


def test_the_bounded_search_finds_the_longest_chunk_near_density_1():
    # the search stops at input_length / (1 - density) + 2, past every raw length whose inputs fit
    raw, _ = input_and_target_lengths(64, 0.99, 3.0)
    assert raw == max(t for t in range(1, 64 * 100) if t5_lengths(t, 0.99, 3.0)[0] <= 64) == 186


@pytest.mark.parametrize("input_length, mean", [(64, 50.0), (64, 100.0), (512, 100.0)] + [(n, 3.0) for n in range(3, 10)])
def test_long_spans_and_short_inputs_give_the_lengths_the_loader_pads_to(input_length, mean):
    # long spans round to 0 spans in T5's length formula while the mask always draws one; inputs of 2-9 tokens cut
    # chunks of 1-2: the lengths and the corrupted chunks disagreed (a broadcast error in the loader's workers)
    raw, targets = input_and_target_lengths(input_length, 0.15, mean)
    chunks = np.arange(3, 3 + 8 * raw, dtype=np.int32).reshape(8, raw) % 900 + 3
    inputs, labels = span_corrupt(chunks, np.random.default_rng(0), vocab_size=1100, eos_id=1,
                                  mean_noise_span_length=mean)
    assert raw >= 2 and inputs.shape[1] <= input_length and labels.shape == (8, targets)


def test_an_input_length_no_chunk_fits_is_one_line_when_the_config_is_read(capsys):
    from pretrain.plan import main as plan

    tiny = "configs/tiny.yaml"
    assert plan(["--config", tiny, "--nodes", "1", "--gpus-per-node", "1", "data.input_length=2"]) == 2
    assert capsys.readouterr().err.strip() == "pretrain.plan: data.input_length (2) must be >= 3"
    assert plan(["--config", tiny, "--nodes", "1", "--gpus-per-node", "1", "data.input_length=3",
                 "data.mean_noise_span_length=100"]) == 0
