"""Under JL, a table row's direction does not depend on which part of a step looks it up
(session 23 audit).

``jl.draw_rows`` draws a table's directions on the rows a batch looks up, matched to the
batch's distinct ids by their order: the vector a row gets depends on the batch's other ids.
Within one batch that is a relabelling of i.i.d. rows (the projections have the law of a
whole direction's). But the parts of a logical step (``max_physical_batch_size``, gradient
accumulation) share one JL seed: rank m of one part and rank m of another (with as many
distinct ids) got the same vector whatever their ids. One example, by moving the part
boundaries, then decided which other examples shared a direction and so their JL clip
factors: 15 crafted pairs moved the released sum by 1.3 C median at r = 5 (16 C at r = 1),
the example's own term ~1e-27 C. Rows alone are now drawn only where tf_dp's Keras step
runs the logical step as one part on one replica (``jl.one_part_step``); parts, replicas
(``tests/keras/distribute_test.py``) and custom loops calling ``clipped_sum`` on parts draw
whole table directions, which give row ``id`` one vector.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.core import jl

_COEF = np.array([1000.0, 0.0, 0.0, 0.0], np.float32)


def _loss(y_true, y_pred):
    return tf.reduce_sum(tf.cast(y_pred, tf.float32) * _COEF, axis=-1)


def _layout(with_z, parts):
    """32 rows with z (weight 1e-30: it adds nothing itself) and b (id 7) among fillers of
    id 1 (and a, id 5). Parts of at most 16 rows: z first, b in the second part at rank 1;
    without z every row moves up one, and b's part has other ranks. Two equal parts
    (accumulation, boundary at n // 2): z last, b at row 15, in the first part with z
    and in the second without."""
    if parts == "max_physical_batch_size":
        ids, z = [1] * 15 + [5] + [1] + [7] + [1] * 14, 0
    else:
        ids, z = [1] * 15 + [7] + [5] + [1] * 15, 31
    weights = [1.0] * 32
    weights[z] = 1e-30
    if not with_z:
        del ids[z], weights[z]
    return np.array(ids, np.int32)[:, None], np.array(weights, np.float32)


@pytest.mark.parametrize("parts", ["max_physical_batch_size", "accumulation"])
def test_a_rows_jl_direction_does_not_depend_on_the_part_that_looks_it_up(parts):
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential(
        [keras.Input((1,), dtype="int32"), keras.layers.Embedding(16, 4),
         keras.layers.Flatten()]))
    opt = tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=1.0,
                      norm_strategy=tf_dp.JL(1),
                      gradient_accumulation_steps=2 if parts == "accumulation" else 1)
    model.compile(optimizer=opt, loss=_loss)
    seed = tf.Variable([11, 22], dtype=tf.int64)
    # The same JL directions in both neighbouring runs (a test's view of the secret seed).
    object.__setattr__(opt, "next_jl_seed", lambda: tf.identity(seed.read_value()))
    if parts == "max_physical_batch_size":
        model._dp_max_rows = 16  # what fit(max_physical_batch_size=16) sets
    x, w = _layout(True, parts)
    model.train_on_batch(x, np.zeros((32, 1), np.float32), sample_weight=w)  # builds
    start = model.get_weights()

    def term_of_b(with_z, s):
        """What b (id 7) alone adds to its row (every other row weighs 0) under seed s."""
        seed.assign([s, 7])
        model.set_weights(start)
        xs, ws = _layout(with_z, parts)
        only = np.where(xs[:, 0] == 7, ws, 0.0).astype(np.float32)
        model.train_on_batch(xs, np.zeros((len(xs), 1), np.float32), sample_weight=only)
        return (model.get_weights()[0][7] - start[0][7]) * len(xs)  # -lr * term / count

    moved = []
    for s in (1, 2, 3):
        with_z, without = term_of_b(True, s), term_of_b(False, s)
        assert np.linalg.norm(with_z) > 0
        moved.append(float(np.max(np.abs(with_z - without)) / np.max(np.abs(with_z))))
    # b's clipped term is the same whether or not z moved the part boundary (it was -2.91
    # with z and -1.53 without at one seed).
    assert max(moved) < 1e-6, moved


def test_rows_alone_only_where_one_part_runs_the_step():
    assert not jl.rows_only_allowed()
    with jl.one_part_step():
        assert jl.rows_only_allowed()
        with jl.one_part_step():
            assert jl.rows_only_allowed()
        assert jl.rows_only_allowed()
    assert not jl.rows_only_allowed()


def test_the_one_part_context_is_per_thread():
    # Review: with one global depth, a custom loop traced in another thread while a one-part
    # Keras step was being traced drew rows alone again.
    import threading

    seen = []
    with jl.one_part_step():
        other = threading.Thread(target=lambda: seen.append(jl.rows_only_allowed()))
        other.start()
        other.join()
        assert jl.rows_only_allowed()
    assert seen == [False]


def test_a_custom_loop_over_parts_with_one_seed_draws_whole_tables():
    # Review of the first fix: clipped_sum called on the parts of one step with one seed
    # (what max_physical_batch_size does) still matched rows by rank: b's term moved by
    # 19-486 % with z, of weight 1e-30, shifting the parts. Whole tables are the default.
    from tf_dp.core import clipped_sum

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(16, 4),
                              keras.layers.Flatten()])
    loss = lambda yt, yp, sw: _loss(yt, yp) * sw  # noqa: E731

    @tf.function
    def two_parts(x, w, seed):
        sums = None
        for lo, hi in ((0, 16), (16, tf.shape(w)[0])):
            out = clipped_sum(model, x[lo:hi], tf.zeros([hi - lo, 1]), w[lo:hi], loss, 1.0,
                              norm_strategy=tf_dp.JL(1), seed=seed, min_rows=16)
            sums = out.grads if sums is None else [a + b for a, b in zip(sums, out.grads)]
        return sums[0][7]

    for s in (1, 2, 3):
        seed = tf.constant([s, 7], tf.int64)
        terms = []
        for with_z in (True, False):
            x, w = _layout(with_z, "max_physical_batch_size")
            only = np.where(x[:, 0] == 7, w, 0.0).astype(np.float32)
            terms.append(two_parts(tf.constant(x), tf.constant(only), seed).numpy())
        np.testing.assert_allclose(terms[0], terms[1], rtol=1e-9)
        assert np.linalg.norm(terms[0]) > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
