"""The synthetic least-squares problem of Li et al. (2022, §4.1) and its excess loss."""

import sys

import numpy as np
import pytest

from tf_dp import analysis


def test_spectrum_is_a_power_law():
    np.testing.assert_allclose(analysis.power_law_spectrum(4, 2.0), [1, 1 / 4, 1 / 9, 1 / 16])
    np.testing.assert_array_equal(analysis.power_law_spectrum(3, 0.0), np.ones(3))


def test_data_has_the_requested_covariance_and_signal():
    x, y, w_star = analysis.linear_regression_data(20000, 5, 1.0, num_informative=2,
                                                   label_noise=0.0, seed=0)
    assert x.shape == (20000, 5) and y.shape == (20000,) and x.dtype == np.float32
    np.testing.assert_allclose(np.var(x, axis=0), [1, 1 / 2, 1 / 3, 1 / 4, 1 / 5], rtol=0.05)
    np.testing.assert_allclose(w_star, [2**-0.5, 2**-0.5, 0, 0, 0])
    np.testing.assert_allclose(y, x @ w_star, atol=1e-5)
    # The same data seed gives the same data (data seeds are not DP seeds).
    x2, _, _ = analysis.linear_regression_data(20000, 5, 1.0, num_informative=2, seed=0)
    np.testing.assert_array_equal(x, x2)


def test_excess_loss_against_a_hand_computation():
    x = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    y = np.array([1.0, 2.0, 3.0])
    w = np.array([0.5, 0.5])
    loss = 0.5 * np.mean((x @ w - y) ** 2)
    assert analysis.least_squares_loss(x, y, w) == pytest.approx(loss)
    optimum = np.linalg.lstsq(x, y, rcond=None)[0]
    best = 0.5 * np.mean((x @ optimum - y) ** 2)
    assert analysis.excess_empirical_loss(x, y, w) == pytest.approx(loss - best)
    assert analysis.excess_empirical_loss(x, y, optimum) == pytest.approx(0, abs=1e-12)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="`decay` must be a finite number >= 0, got -1"):
        analysis.power_law_spectrum(3, -1.0)
    with pytest.raises(ValueError, match="`dim` must be an integer >= 1"):
        analysis.linear_regression_data(10, 0, 1.0)
    with pytest.raises(ValueError, match="`num_informative` must be <= `dim`"):
        analysis.linear_regression_data(10, 3, 1.0, num_informative=4)
    with pytest.raises(ValueError, match="`label_noise`"):
        analysis.linear_regression_data(10, 5, 1.0, label_noise=-0.1)
    with pytest.raises(ValueError, match="`weights` must have one entry per column"):
        analysis.least_squares_loss(np.ones((3, 2)), np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="`y` must have one entry per row"):
        analysis.least_squares_loss(np.ones((3, 2)), np.ones(2), np.ones(2))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
