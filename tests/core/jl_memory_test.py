"""JL memory: directions drawn late and per weight, embedding rows only, fewer materialised
per-example gradients (docs/scaling.md, section 3 (c) and (d)).

* Every projection the JL strategy forms equals ``<g_i, v_j>`` from float64 brute-force
  per-example gradients (a loop over single examples) and the directions the step draws
  (``jl.directions``; for an embedding table with ghost factors, ``jl.draw_rows`` on the
  batch's distinct ids), on each changed path: outer-product factors projected or
  materialised, embedding tables through their factors and through forward-mode JVPs (the
  whole table), repeated ids across examples, ``mask_zero`` padding.
* The directions of every weight drawn whole are the same numbers as before (the old
  ``jl.directions`` is copied below).
* Rows drawn alone: ``<g_i, v>`` over many seeds has the law N(0, ||g_i||^2) (chi-square and
  KS checks whose power against per-position directions and a 20 % variance error is shown),
  and examples that look up one row see one vector.
* Graph: each weight's draw has a control input from its own factors.
"""

import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tests import _reference
from tf_dp.core import build_per_example_loss, clipped_sum, jl
from tf_dp.core.ghost.factors import (EmbeddingFactors, FactorOptions, OuterFactors,
                                      _materialise_for_projection)

L = keras.layers
_ALPHA = 1e-4  # family-wise false-alarm level of each statistical test


def _seed(a, b):
    return tf.constant([a, b], tf.int64)


def _old_directions(variables, num_projections, seed):
    """``jl.directions`` as the formula from public ops and NumPy (every direction one
    ``tests._reference.normal`` on its documented seed, ``_reference.jl_direction_seed``),
    as NumPy arrays."""
    n = len(variables)
    return [[_reference.normal(v.shape, _reference.jl_direction_seed(
        seed, i, j, num_projections, n), v.dtype) for i, v in enumerate(variables)]
        for j in range(num_projections)]


def _close(got, want):
    # NumPy's and TensorFlow's log / cos / sin may differ in the last bits (a few ulps).
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=4 * float(np.finfo(got.dtype).eps),
                               atol=8 * float(np.finfo(got.dtype).eps))


# ------------------------------------------------------------------ models


class _PlainEmbedding(L.Embedding):
    """An Embedding with an overridden call: no ghost rule, so its table's per-example
    gradients come from the vectorized fallback, as row gradients (directions on the
    looked-up rows only, like a ghost table's)."""

    def call(self, inputs):
        return super().call(inputs)


def _model(kind):
    """float64 models whose weights take every changed path (see the module doc)."""
    keras.utils.set_random_seed(4)
    f = "float64"
    ids = keras.Input((6,), dtype="int32")
    if kind == "masked":
        # mask_zero: padded positions (id 0) get no gradient through the masked pooling.
        z = L.Embedding(30, 8, mask_zero=True, dtype=f)(ids)
        z = L.Dense(80, activation="tanh", dtype=f)(z)       # d*p=640: materialised (r>1)
        z = L.GlobalAveragePooling1D(dtype=f)(z)
    else:
        z = L.Embedding(30, 64, dtype=f)(ids)
        if kind == "mixed":  # a second table without ghost factors (vectorized fallback)
            z = L.Add(dtype=f)([z, _PlainEmbedding(25, 64, dtype=f)(ids)])
        z = L.Dense(90, activation="tanh", dtype=f)(z)       # d*p=5760: projected factors
        z = L.LayerNormalization(dtype=f)(z)                # per-example gradients (direct)
        z = L.Conv1D(4, 3, activation="tanh", dtype=f)(z)   # d*p=1080: materialised (r>1)
        z = L.Flatten(dtype=f)(z)
    out = L.Dense(2, dtype=f)(z)
    return keras.Model(ids, out)


def _ids(kind, n=5):
    rng = np.random.default_rng(1)
    x = rng.integers(1, 12, size=(n, 6)).astype("int32")  # 11 rows: many repeats
    x[0, :3] = x[1, 3:] = 7  # one row repeated within and across examples
    if kind == "masked":
        x[:, 4:] = 0  # padding
        x[2, 1:] = 0
    return x


def _brute_projections(model, loss_fn, x, y, r, seed):
    """(r, B) ``<g_i, v_j>`` in float64: per-example gradients by a loop over examples,
    directions from jl.directions."""
    per = _reference.per_example_gradients(model, loss_fn, x, y)
    variables = model.trainable_variables
    dirs = [[d.numpy() for d in dj] for dj in jl.directions(variables, r, seed)]
    # A table read by row lookups (ghost factors, or the fallback's row gradients) gets its
    # directions on the batch's distinct ids only, in their order of first appearance
    # (tf.unique); other rows get no gradient, so any values do there.
    rows = list(dict.fromkeys(np.asarray(x).ravel().tolist()))
    tables = [layer.embeddings for layer in model.layers if isinstance(layer, L.Embedding)]
    for i, v in enumerate(variables):
        if any(v is t for t in tables):
            drawn = jl.draw_rows(v, i, r, seed, len(rows)).numpy()
            for j in range(r):
                dirs[j][i] = np.zeros(v.shape)
                dirs[j][i][rows] = drawn[j]
    return np.array([[sum(float(np.sum(p[i] * d)) for p, d in zip(per, dirs[j]))
                      for i in range(len(x))] for j in range(r)])


@pytest.mark.parametrize("kind", ["plain", "masked", "mixed"])
@pytest.mark.parametrize("r", [1, 3])
def test_jl_norms_are_those_of_brute_force_projections(kind, r):
    model = _model(kind)
    x = _ids(kind)
    y = np.random.default_rng(2).normal(size=(len(x), 2))
    loss_fn = build_per_example_loss("mse")
    seed = _seed(13, r)
    want = _brute_projections(model, loss_fn, x, y, r, seed)
    assert np.all(np.abs(want) > 1e-6)  # every example reaches the tables
    @tf.function
    def fn(a, b, s):
        with jl.one_part_step():  # as the Keras step runs one part: rows alone
            return clipped_sum(model, a, b, None, loss_fn, 1e9, norm_strategy="jl",
                               num_projections=r, seed=s).norms

    got = fn(tf.constant(x), tf.constant(y), seed).numpy()
    np.testing.assert_allclose(got, np.sqrt(np.mean(want ** 2, axis=0)), rtol=1e-9)
    if r == 1:  # another batch in the same trace: other rows, drawn again
        x2 = (x + 3) % 30
        want2 = _brute_projections(model, loss_fn, x2, y, r, seed)
        np.testing.assert_allclose(fn(tf.constant(x2), tf.constant(y), seed).numpy(),
                                   np.abs(want2[0]), rtol=1e-9)


def test_the_models_take_the_paths_they_are_meant_to():
    shape = lambda t, d: tf.TensorSpec([None, t, d])  # noqa: E731
    # Dense(90) on (B, 6, 64): 5760 > max(4096, 6 * 154): projected factors.
    assert not _materialise_for_projection(shape(6, 64), shape(6, 90), 3)
    # Conv1D(4, 3) on (B, 6, 90): patches (B, 4, 270), 1080 <= 4096: materialised.
    assert _materialise_for_projection(shape(4, 270), shape(4, 4), 3)
    assert _materialise_for_projection(shape(4, 270), shape(4, 4), 1)
    # The BiLSTM's LSTM(64) kernels (T = 150, d = 64, 4H = 256), r = 1 too: materialising
    # replaces a projection and a weighted sum of B*T*d*p each by one.
    assert _materialise_for_projection(shape(150, 64), shape(150, 256), 1)
    # One position (a Dense layer on (B, d)): the factors are projected.
    assert not _materialise_for_projection(shape(1, 64), shape(1, 256), 5)


# ------------------------------------------------------------------ (c) materialising


@pytest.mark.parametrize("t,d,p,r", [(64, 256, 256, 5), (25, 256, 32, 5), (64, 256, 1024, 5),
                                     (150, 64, 256, 5), (196, 9, 64, 5), (4, 30, 40, 3),
                                     (4, 30, 40, 1), (1, 300, 300, 5), (150, 64, 256, 1),
                                     (2, 64, 64, 1), (1, 8, 8, 1)])
def test_materialise_only_when_no_larger_than_the_factors_or_small(t, d, p, r):
    a, g = tf.TensorSpec([None, t, d]), tf.TensorSpec([None, t, p])
    # Fewer flops whenever T >= 2 (the weighted sum counted: (r + 1) d p <= r T d p);
    # memory: no larger than the factors, or small.
    want = t >= 2 and (d * p <= t * (d + p) or d * p <= 4096)
    assert _materialise_for_projection(a, g, r) == want
    # The Transformer's attention (d = p = 256, T = 64, r = 5) was materialised by the
    # r-fold bound (65,536 <= 5 * 64 * 256): one 256 KiB gradient per example per weight.
    if (t, d, p, r) == (64, 256, 256, 5):
        assert not want


def _outer_case(t, d, p, b=5, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(b, t, d)) * scale
    g = rng.normal(size=(b, t, p)) / scale
    a[1] *= 1e6  # huge and tiny examples
    g[2] *= 1e-6
    a[3, :, 0] = 1e3  # ill-conditioned: one dominant column
    return a.astype("float32"), g.astype("float32")


@pytest.mark.parametrize("t,d,p", [(4, 30, 40), (6, 64, 90), (3, 20, 7)])
@pytest.mark.parametrize("r", [1, 4])
def test_outer_projections_and_sums_match_float64(t, d, p, r):
    a, g = _outer_case(t, d, p)
    var = tf.Variable(tf.zeros([d, p]), name="kernel")
    f = OuterFactors(var, tf.constant(a), tf.constant(g),
                     FactorOptions(exact_norms=False, num_projections=r))
    materialised = _materialise_for_projection(tf.constant(a), tf.constant(g), r)
    assert (f.per is not None) == materialised
    v = jl.draw(var, 3, r, _seed(2, 9))
    per = np.einsum("btd,btp->bdp", a.astype(np.float64), g.astype(np.float64))
    want = np.einsum("bdp,jdp->jb", per, v.numpy().astype(np.float64))
    got = f.project(v).numpy()
    # float32 products: error within ~1e-5 of sum |a||v||g| per example.
    scale = np.einsum("btd,btp->b", np.abs(a), np.abs(g)) * np.abs(v.numpy()).max()
    assert np.all(np.abs(got - want) <= 1e-5 * scale[None]), (got, want)
    w = np.array([1.0, 1e-6, 1e6, 0.5, 0.0], "float32")
    want_sum = np.einsum("b,bdp->dp", w.astype(np.float64), per)
    sum_scale = np.einsum("b,btd,btp->dp", w, np.abs(a), np.abs(g))
    assert np.all(np.abs(f.weighted_sum(tf.constant(w)).numpy() - want_sum)
                  <= 1e-5 * sum_scale + 1e-30)


# ------------------------------------------------------------------ (d) directions


def _variables():
    model = _model("mixed")
    return model, model.trainable_variables


def test_whole_directions_are_unchanged_and_rows_come_from_their_own_stream():
    _, variables = _variables()
    seed, r = _seed(5, 17), 3
    new = jl.directions(variables, r, seed)
    old = _old_directions(variables, r, seed)
    for i, v in enumerate(variables):
        for j in range(r):
            got = new[j][i].numpy()
            assert got.shape == tuple(v.shape) and got.dtype == v.dtype
            _close(got, old[j][i])
            _close(jl.draw(v, i, r, seed, projection=j).numpy(), got)
        if len(v.shape) != 2:
            continue
        rows = jl.draw_rows(v, i, r, seed, 4).numpy()
        assert rows.shape == (r, 4, v.shape[1]) and rows.dtype == v.dtype
        for j in range(r):
            s = _reference.jl_direction_seed(seed, i, j, r, len(variables))
            want = _reference.normal([4, v.shape[1]], _reference.fold_seed(s, jl._ROWS_STREAM),
                                     v.dtype)
            _close(rows[j], want)
            # not rows of the whole direction (their own stream)
            assert not np.any(np.all(rows[j][:, None] == new[j][i].numpy()[None], axis=-1))
    assert not np.allclose(new[0][0].numpy(), new[1][0].numpy())


def test_rows_drawn_alone_handle_no_rows_and_other_dtypes():
    var = tf.Variable(tf.zeros([9, 5], tf.float64), name="embeddings")
    empty = jl.draw_rows(var, 0, 2, _seed(1, 1), 0)
    assert empty.shape == (2, 0, 5) and empty.dtype == tf.float64
    many = jl.draw_rows(var, 0, 70, _seed(1, 1), tf.constant(2))
    assert many.shape == (70, 2, 5)
    assert len({tuple(np.round(m, 12).ravel()) for m in many.numpy()}) == 70


def _embedding_case():
    """ids with rows repeated within and across examples; g equal on the repeats, so that
    directions drawn per position (wrong) have another variance than per row."""
    ids = np.array([[1, 1, 2, 3, 0, 0],
                    [1, 4, 4, 4, 5, 2],
                    [7, 7, 7, 7, 7, 7],
                    [3, 8, 9, 10, 11, 2]], "int32")
    rng = np.random.default_rng(3)
    g = rng.normal(size=(4, 6, 5))
    g[1, 1:4] = g[1, 1]
    g[2, :] = g[2, 0]
    g[0, 4:] = 0.0  # padding positions
    dense = np.zeros((4, 12, 5))
    for i in range(4):
        np.add.at(dense[i], ids[i], g[i])
    return ids, g.astype("float32"), dense


def _law_check(p, sq, alpha):
    """(ok, reason): columns of ``p`` (K, B) are N(0, sq_i) samples (sum of squares ~
    chi2_K, mean, KS), each at level alpha / (3 B)."""
    k, b = p.shape
    level = alpha / (3 * b)
    lo, hi = stats.chi2.ppf([level / 2, 1 - level / 2], k)
    zmax = stats.norm.ppf(1 - level / 2)
    for i in range(b):
        z = p[:, i] / math.sqrt(sq[i])
        if not lo < np.sum(z ** 2) < hi:
            return False, f"example {i}: sum z^2 = {np.sum(z ** 2):.1f} not in ({lo:.1f}, {hi:.1f})"
        if abs(np.mean(z)) * math.sqrt(k) > zmax:
            return False, f"example {i}: mean {np.mean(z):.3f}"
        if stats.kstest(z, "norm").pvalue < level:
            return False, f"example {i}: KS"
    return True, ""


def test_rows_only_projection_has_the_law_of_a_full_direction():
    ids, g, dense = _embedding_case()
    var = tf.Variable(tf.zeros([12, 5]), name="embeddings")
    f = EmbeddingFactors(var, tf.constant(ids), tf.constant(g), FactorOptions(exact_norms=False))
    r, steps = 8, 250

    @tf.function
    def project(seed):
        rows, pos = f.unique_rows()
        return f.project_rows(jl.draw_rows(var, 2, r, seed, tf.size(rows)), pos)

    p = np.concatenate([project(_seed(31, s)).numpy() for s in range(steps)]).astype(np.float64)
    sq = np.sum(dense.astype(np.float64) ** 2, axis=(1, 2))
    ok, why = _law_check(p, sq, _ALPHA)
    assert ok, why
    # Power: the same check rejects directions drawn per position (independent vectors for
    # repeated ids: variance sum_t ||g_it||^2) and a 20 % error in the variance.
    rng = np.random.default_rng(0)
    k = p.shape[0]
    per_position = np.einsum("btd,kbtd->kb", g.astype(np.float64),
                             rng.normal(size=(k,) + g.shape))
    assert not _law_check(per_position, sq, _ALPHA)[0]
    assert not _law_check(p * math.sqrt(1.2), sq, _ALPHA)[0]
    assert not _law_check(p * math.sqrt(0.8), sq, _ALPHA)[0]


def test_examples_looking_up_one_row_see_one_vector():
    var = tf.Variable(tf.zeros([12, 5]), name="embeddings")
    u = np.random.default_rng(5).normal(size=5)
    ids = np.array([[4, 1, 2], [3, 6, 4], [5, 4, 9], [8, 8, 1]], "int32")
    g = np.zeros((4, 3, 5), "float32")
    g[0, 0] = g[1, 2] = g[2, 1] = u  # row 4 in three examples, at different positions
    g[3, 0] = u  # row 8
    f = EmbeddingFactors(var, tf.constant(ids), tf.constant(g), FactorOptions(exact_norms=False))
    for s in range(5):
        seed = _seed(8, s)
        rows, pos = f.unique_rows()
        drawn = jl.draw_rows(var, 0, 2, seed, tf.size(rows))
        p = f.project_rows(drawn, pos).numpy()
        np.testing.assert_array_equal(p[:, 0], p[:, 1])
        np.testing.assert_array_equal(p[:, 0], p[:, 2])
        assert np.all(p[:, 3] != p[:, 0])
        # ... and it is the vector drawn for row 4, at its place among the distinct ids.
        m = list(rows.numpy()).index(4)
        want = np.einsum("d,jd->j", u, drawn.numpy()[:, m])
        np.testing.assert_allclose(p[:, 0], want, rtol=1e-5)


# ------------------------------------------------------------------ graph: drawn late


_DRAW_OPS = {"StatelessRandomUniformFullIntV2", "While", "StatelessWhile"}


def _is_words(op):
    """A draw of the uint64 words of Gaussian directions (``tf_dp.core.gaussian``)."""
    return _reference.is_words_draw(op)


_ancestors = _reference.ancestor_ops


def test_each_weights_directions_are_drawn_after_its_factors():
    model = _model("plain")
    graph, captured = _reference.traced_factors(model, tf_dp.JL(3), _ids("plain"),
                                                np.zeros((5, 2)), _seed(1, 2))
    ops = graph.get_operations()
    draws = [op for op in ops if op.type in _DRAW_OPS
             and any(_is_words(o) for o in _body_ops(op))]
    assert draws
    for k, (v, f) in enumerate(zip(model.trainable_variables, captured)):
        mine = [op for op in draws if op.name.startswith(f"jl_directions_{k}/")]
        assert mine, f"no direction draw of {v.path} in its own scope"
        deps = {t.op for t in f.dependencies()}
        for op in mine:
            assert deps <= _ancestors(op), f"{op.name} ({v.path}) is not after its factors"
    # No draw anywhere that is not after some factors (the old code drew every direction
    # from the seed alone, at the start of the step).
    gradient_ops = {t.op for f in captured for t in f.dependencies()}
    for op in draws:
        assert _ancestors(op) & gradient_ops, f"{op.name} is drawn from the seed alone"


def _body_ops(op):
    """The op itself, or for a loop the ops of its body function."""
    if op.type not in ("While", "StatelessWhile"):
        return [op]
    body = op.get_attr("body").name
    fn = op.graph._get_function(body)  # noqa: SLF001 (the loop's body graph)
    return list(fn.graph.get_operations()) if fn is not None else []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
