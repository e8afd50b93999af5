"""LSG unit importances and keep-masks."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.layers.lsg import lsg_masks, num_kept_units, top_units_mask, unit_importances


def test_unit_importances_are_row_and_column_l1_norms():
    w = np.array([[1.0, -2.0, 0.5], [-3.0, 0.0, 4.0]], np.float32)
    inputs, outputs = unit_importances(tf.constant(w))
    np.testing.assert_allclose(inputs, [3.5, 7.0])
    np.testing.assert_allclose(outputs, [4.0, 2.0, 4.5])


@pytest.mark.parametrize(
    "units, sparsity, kept",
    [(10, 0.3, 7), (10, 0.7, 3), (10, 0.5, 5), (3, 0.5, 2), (5, 0.99, 1), (7, None, 7), (7, 0, 7)],
)
def test_num_kept_units_is_ceil_of_kept_fraction(units, sparsity, kept):
    assert num_kept_units(units, sparsity) == kept


def test_top_units_mask_keeps_exactly_the_most_important():
    importance = np.random.default_rng(0).permutation(12).astype(np.float32)
    mask = top_units_mask(tf.constant(importance), 5).numpy()
    assert mask.sum() == 5
    np.testing.assert_array_equal(mask, (importance >= 7).astype(np.float32))


def test_top_units_mask_breaks_ties_by_lower_index():
    mask = top_units_mask(tf.ones([6]), 2).numpy()
    np.testing.assert_array_equal(mask, [1, 1, 0, 0, 0, 0])


def test_lsg_masks_per_side():
    w = tf.constant(np.random.default_rng(1).normal(size=(8, 5)), tf.float32)
    input_mask, output_mask = lsg_masks(unit_importances(w), sparsity=0.5)
    assert input_mask.numpy().sum() == 4 and output_mask.numpy().sum() == 3
    rows, cols = (np.abs(w.numpy()).sum(axis=1), np.abs(w.numpy()).sum(axis=0))
    assert rows[input_mask.numpy() == 1].min() > rows[input_mask.numpy() == 0].max()
    assert cols[output_mask.numpy() == 1].min() > cols[output_mask.numpy() == 0].max()


def test_lsg_masks_without_sparsity_are_all_ones():
    for mask in lsg_masks((tf.ones([4]), tf.ones([3])), None):
        np.testing.assert_array_equal(mask, np.ones(mask.shape))


@pytest.mark.parametrize("sparsity", [1.0, -0.1, 1.5])
def test_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match="`sparsity`"):
        lsg_masks((tf.ones([4]), tf.ones([3])), sparsity)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
