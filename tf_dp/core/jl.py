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


def directions(variables, num_projections: int, seed):
    """r standard Gaussian directions: a list over j of lists over variables.

    ``seed`` is a (2,) int tensor (the optimizer's noise seed and step): the same seed gives
    the same projections.
    """
    base = tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int64), _DIRECTION_STREAM)
    out = []
    for j in range(num_projections):
        sj = tf.random.experimental.stateless_fold_in(base, j)
        out.append([tf.random.stateless_normal(v.shape, seed=tf.random.experimental
                                               .stateless_fold_in(sj, i), dtype=v.dtype)
                    for i, v in enumerate(variables)])
    return out


def jl_norms(projections):
    """``M_i = sqrt(mean_j P_ij^2)`` from the (r, B) matrix of projections, in float64
    (float32 squares overflow above 1.8e19; the clip factors are formed from these)."""
    p = tf.cast(projections, tf.float64)
    return tf.sqrt(tf.reduce_mean(tf.square(p), axis=0))


def forward_projections(model, per_example_loss, x, y, sample_weight, variables, dirs,
                        tape=None, replay=None):
    """``P[j, i] = <grad_variables l_i, dirs[j]>`` by one forward-mode pass per direction.

    ``dirs`` is a list over j of lists over ``variables``. The first pass is recorded by
    ``tape`` if given. ``replay`` (from :func:`save_random_state`) resets dropout-like random
    state before every pass, so all passes (and any earlier one) see the same masks.

    Returns (per-example losses of the first pass, its outputs, projections (r, B)).
    """
    prims = [v.value if hasattr(v, "value") else v for v in variables]
    gens, saved = replay if replay is not None else save_random_state(model)
    projections, losses0, pred0 = [], None, None
    with vmap.vectorizable(model):  # unrolled RNNs: forward-mode AD needs no TensorArrays
        for j, dirs_j in enumerate(dirs):
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

