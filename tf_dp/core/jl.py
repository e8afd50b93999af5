"""Per-example gradient norms by Johnson-Lindenstrauss projections (forward-mode AD).

Bu, Gopi, Kulkarni, Lee, Shen, Tantipongpipat 2021, "Fast and Memory Efficient
Differentially Private-SGD via JL Projections", Algorithm 1:

    v_1..v_r ~ N(0, I) over all trainable parameters
    P_ij = <grad l_i, v_j>            one JVP of the per-example loss vector per direction
    M_i  = sqrt(mean_j P_ij^2)        E[M_i^2] = ||grad l_i||^2
    backpropagate sum_i l_i / max(1, M_i / C)   (scale under stop_gradient)

Works for any architecture. For weights of layers with a ghost-norm rule (Dense, Conv,
Embedding, normalisations, EinsumDense, LSTM, the reparametrized layers) ``P_ij`` comes
from the factors one ordinary backward pass records (``sum_t a_it^T v_j dz_it``): the same
number forward-mode AD would give, at the cost of r small products per layer instead of r
forward passes. Every other weight gets its ``P_ij`` from JVPs computed with
``tf.autodiff.ForwardAccumulator`` on the layers' own forward pass. Keras recurrent layers
are unrolled while traced (their while_loop over TensorArrays has no forward-mode rule), and
the random state of dropout-like layers is replayed so every JVP and the backward pass see
the same masks: the norm estimate then describes exactly the gradient that is clipped.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp import _internals
from tf_dp.core import vmap

_DIRECTION_STREAM = 0x4A4C  # separates projection seeds from noise seeds ("JL")

#: rows of a row-seeded direction drawn per iteration of the drawing loop, over all r
#: directions (the loop's overhead per iteration is shared by this many small draws).
_ROW_DRAWS_PER_ITERATION = 64


def row_seeded(variable) -> bool:
    """Whether ``variable``'s directions are drawn row by row: embedding tables (a 2-D
    weight named ``embeddings``, as ``keras.layers.Embedding``'s).

    Row ``k`` of such a direction is ``stateless_normal([width], fold_in(s, k))`` for the
    variable's seed ``s``, so the rows a batch looks up can be drawn alone (O(r B T width)
    instead of O(r vocabulary width)) and are the same numbers as in the full direction:
    every example that looks a row up, and every way of projecting, sees the same vector.
    Every other weight's direction is one ``stateless_normal(shape, s)``.
    """
    name = getattr(variable, "name", "") or ""
    return (len(variable.shape) == 2
            and name.split(":")[0].rsplit("/", 1)[-1] == "embeddings")


def _variable_seeds(num_projections: int, seed, index: int):
    """The r seeds of variable number ``index``: ``fold_in(fold_in(base, j), index)``."""
    base = tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int64), _DIRECTION_STREAM)
    return [tf.random.experimental.stateless_fold_in(
        tf.random.experimental.stateless_fold_in(base, j), index)
        for j in range(num_projections)]


def draw(variable, index: int, num_projections: int, seed, projection=None):
    """The r directions of variable number ``index`` (of the list given to
    :func:`directions`): (r, *variable.shape); only direction ``projection`` (in the
    variable's shape) if that is given."""
    seeds = _variable_seeds(num_projections, seed, index)
    if projection is not None:
        seeds = seeds[projection:projection + 1]
    if row_seeded(variable):
        out = _draw_rows(variable, seeds, tf.range(variable.shape[0], dtype=tf.int32))
    else:
        out = tf.stack([tf.random.stateless_normal(variable.shape, seed=s, dtype=variable.dtype)
                        for s in seeds])
    return out if projection is None else out[0]


def draw_rows(variable, index: int, num_projections: int, seed, rows):
    """Rows ``rows`` (int32 (U,)) of the r directions of the row-seeded variable number
    ``index``: (r, U, width), the same numbers as those rows of :func:`draw`'s."""
    return _draw_rows(variable, _variable_seeds(num_projections, seed, index), rows)


def _draw_rows(variable, seeds, rows):
    r, width, dtype = len(seeds), variable.shape[1], variable.dtype
    # fold_in(s, k) = [uniform_full_int(s), k] (k int32): its first word once per seed.
    firsts = tf.stack([tf.random.experimental.stateless_fold_in(s, 0)[0] for s in seeds])
    chunk = max(1, _ROW_DRAWS_PER_ITERATION // r)
    n = tf.shape(rows)[0]
    padded = tf.reshape(tf.pad(rows, [[0, (-n) % chunk]]), [-1, chunk])

    def body(ks):
        return tf.stack([tf.stack([
            tf.random.stateless_normal([width], seed=tf.stack([firsts[j], ks[m]]), dtype=dtype)
            for j in range(r)]) for m in range(chunk)])

    out = tf.map_fn(body, padded, fn_output_signature=tf.TensorSpec([chunk, r, width], dtype))
    out = tf.reshape(out, [-1, r, width])[:n]
    return tf.transpose(out, [1, 0, 2])


def directions(variables, num_projections: int, seed):
    """r standard Gaussian directions: a list over j of lists over variables.

    ``seed`` is a (2,) int tensor (the optimizer's noise seed and step): the same seed gives
    the same projections. Variable ``i``'s direction ``j`` has seed ``fold_in(fold_in(base,
    j), i)`` (drawn row by row for embedding tables, :func:`row_seeded`); the JL strategy
    draws each variable's directions alone (:func:`draw`), the same numbers.
    """
    per_variable = [draw(v, i, num_projections, seed) for i, v in enumerate(variables)]
    return [[d[j] for d in per_variable] for j in range(num_projections)]


def jl_norms(projections):
    """``M_i = sqrt(mean_j P_ij^2)`` from the (r, B) matrix of projections, in float64
    (float32 squares overflow above 1.8e19; the clip factors are formed from these)."""
    p = tf.cast(projections, tf.float64)
    return tf.sqrt(tf.reduce_mean(tf.square(p), axis=0))


def forward_projections(model, per_example_loss, x, y, sample_weight, variables, dirs,
                        tape=None, replay=None):
    """``P[j, i] = <grad_variables l_i, dirs[j]>`` by one forward-mode pass per direction.

    ``dirs`` is a list over j of lists over ``variables``, or a pair (r, ``j -> list over
    variables``): then direction j is drawn only after pass j - 1's projections (under a
    control dependency), so one direction exists at a time. The first pass is recorded by
    ``tape`` if given. ``replay`` (from :func:`save_random_state`) resets dropout-like random
    state before every pass, so all passes (and any earlier one) see the same masks.

    Returns (per-example losses of the first pass, its outputs, projections (r, B)).
    """
    prims = [v.value if hasattr(v, "value") else v for v in variables]
    gens, saved = replay if replay is not None else save_random_state(model)
    projections, losses0, pred0 = [], None, None
    if isinstance(dirs, tuple):
        num, draw_j = dirs
    else:
        num, draw_j = len(dirs), dirs.__getitem__
    with vmap.vectorizable(model):  # unrolled RNNs: forward-mode AD needs no TensorArrays
        for j in range(num):
            with tf.control_dependencies(projections[-1:]):
                dirs_j = draw_j(j)
            for g, s in zip(gens, saved):
                g.state.assign(s)
            with tf.autodiff.ForwardAccumulator(prims, dirs_j) as acc:
                if j == 0 and tape is not None:
                    with tape:
                        pred = model(x, training=True)
                        losses = per_example_loss(y, pred, sample_weight)
                else:
                    pred = model(x, training=True)
                    losses = per_example_loss(y, pred, sample_weight)
                if j == 0:
                    losses0, pred0 = losses, pred
            jvp = acc.jvp(losses, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            projections.append(jvp)
    return losses0, pred0, tf.stack(projections)


def save_random_state(model):
    """The model's seed generators and copies of their current states (for replay)."""
    gens = [g for layer in _internals.all_layers(model)
            for g in _internals.seed_generators(layer)]
    return gens, [tf.identity(g.state.value) for g in gens]

