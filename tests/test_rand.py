"""Seeded inputs: reproducible from the seed alone, with the intended distributions."""

import numpy as np
import pytest
from scipy import stats

from oracle.core import rand


def test_same_seed_same_bits_different_seed_different_bits():
    """Two generators from one seed give identical streams; another seed differs."""
    a = rand.normal(rand.generator(7), (1000,))
    b = rand.normal(rand.generator(7), (1000,))
    c = rand.normal(rand.generator(8), (1000,))
    assert np.array_equal(a.view(np.uint64), b.view(np.uint64))
    assert not np.array_equal(a, c)


def test_raw_stream_is_numpys_guaranteed_pcg64_stream():
    """The transforms start from PCG64.random_raw, the stream NumPy keeps stable (NEP 19)."""
    bg = rand.generator(3)
    assert np.array_equal(rand.raw_u64(bg, (5,)), np.random.PCG64(3).random_raw(5))


def test_in_place_transforms_give_the_literal_expressions_bits():
    """uniform and normal, evaluated in place, equal bit for bit their literal forms on the
    raw stream: ((raw >> 11) + 0.5) * 2^-53 and sqrt(-2 log u1) * cos(2 pi u2), in shapes
    of one and several axes (the bits every case's input hash records)."""
    for shape in [(7,), (3, 5, 4), (100_003,)]:
        raw = np.random.PCG64(5).random_raw(4 * int(np.prod(shape))).reshape(4, *shape)
        u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        bg = rand.generator(5)
        assert np.array_equal(rand.uniform(bg, shape).view(np.uint64), u[0].view(np.uint64))
        assert np.array_equal(rand.uniform(bg, shape).view(np.uint64), u[1].view(np.uint64))
        literal = np.sqrt(-2.0 * np.log(u[2])) * np.cos(2.0 * np.pi * u[3])
        assert np.array_equal(rand.normal(bg, shape).view(np.uint64), literal.view(np.uint64))


def test_distributions():
    """uniform is U(0,1), normal is N(0,1) (Kolmogorov-Smirnov, fixed seed, p > 1e-3);
    integers stay in [low, high) and hit every value."""
    bg = rand.generator(11)
    u = rand.uniform(bg, (100_000,))
    assert 0 < u.min() and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    assert stats.kstest(rand.normal(bg, (100_000,)), "norm").pvalue > 1e-3
    k = rand.integers(bg, -3, 5, (10_000,))
    assert set(np.unique(k)) == set(range(-3, 5))
    p = rand.permutation(bg, 50)
    assert sorted(p) == list(range(50))


def test_bad_seed_is_rejected():
    with pytest.raises(ValueError, match="^seed "):
        rand.generator(-1)
