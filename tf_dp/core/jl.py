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
forward passes. Every other weight's per-example gradients are materialised by the
vectorized fallback and projected. Either way the estimate is formed from the very tensors
the clipped sum adds up, and the clip bound is kept above what the rounding of those sums can
add beyond them (``tf_dp.core.norm_strategies.jl_clip_bounds``). (Until session 14 the
other weights were projected by forward-mode JVPs and summed by a weighted backward pass: two
computations whose rounding differed, which one example with cancelling terms could use to
erase every other example's gradient.)
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tf_dp.core import gaussian, randomness

_DIRECTION_STREAM = 0x4A4C  # separates projection seeds from noise seeds ("JL")

#: separates the seeds of a table's rows drawn alone from its whole directions' seeds.
_ROWS_STREAM = 0x524F  # "RO"


_ONE_PART = threading.local()


@contextlib.contextmanager
def one_part_step():
    """Within it, JL steps traced may draw a table's directions on the looked-up rows only
    (``draw_rows``); everywhere else they draw whole directions. Entered by tf_dp's Keras
    step around a logical step run as ONE batch: the only place that knows its step seed is
    not shared with another part.

    ``draw_rows`` matches its rows to a batch's distinct ids by their order, so its vector
    for an id depends on the batch's other ids. Within one batch that is a relabelling of
    i.i.d. rows. Across parts of one step that share a seed it is not: rank m of one part
    and rank m of another (with as many distinct ids) got the same vector whatever their
    ids, and one example, by moving the part boundaries, decided which other examples
    shared a direction (their JL clip factors then moved the sum by 1.3 C median at r = 5
    and 16 C at r = 1, the example's own term ~1e-27 C; session 23 audit). The parts of
    ``max_physical_batch_size`` and gradient accumulation, replicas (which share the
    step's seed), and any custom loop calling ``clipped_sum`` on parts with one seed (the
    review of the first fix: 19-486 % moves of another example's term) therefore draw
    whole directions, which give row ``id`` one vector wherever it is looked up. Per
    thread: a custom loop traced in another thread meanwhile must not be let in (review:
    the first, global depth did); each replica enters it in its own tracing thread."""
    _ONE_PART.depth = getattr(_ONE_PART, "depth", 0) + 1
    try:
        yield
    finally:
        _ONE_PART.depth -= 1


def rows_only_allowed() -> bool:
    """Whether a table's directions may be drawn on the looked-up rows alone: inside
    ``one_part_step`` and on one replica (replicas share the step's JL seed, and each looks
    up its own share of the batch)."""
    if not getattr(_ONE_PART, "depth", 0):
        return False
    return tf.distribute.get_strategy().num_replicas_in_sync == 1


def step_seeds(num_projections: int, seed, num_variables: int):
    """The seeds of every direction of a step: ``seeds[k][j]``, (2,) int64, of variable k's
    direction j: row ``k * r + j`` of ``split_seed(fold_seed(seed, _DIRECTION_STREAM),
    r * V)`` (``tf_dp.core.randomness``), so every direction's seed has all 128 secret bits
    of the step's seed. (``stateless_fold_in`` chains, used until session 13, left 32: a
    search over 2^32 candidates would have found the directions of a step.) Two graph ops
    for all of them; a variable's row does not depend on how many variables are split.
    """
    r, v = num_projections, num_variables
    rows = tf.unstack(randomness.split_seed(randomness.fold_seed(seed, _DIRECTION_STREAM),
                                            r * v), r * v)
    return [[rows[k * r + j] for j in range(r)] for k in range(v)]


def _variable_seeds(num_projections: int, seed, index: int, seeds=None):
    """Variable ``index``'s r direction seeds (``seeds`` if given, from :func:`step_seeds`)."""
    if seeds is None:
        seeds = step_seeds(num_projections, seed, index + 1)[index]
    if len(seeds) != num_projections:
        raise ValueError(f"{len(seeds)} seeds for {num_projections} directions.")
    return seeds


def draw(variable, index: int, num_projections: int, seed, projection=None, seeds=None):
    """The r directions of variable number ``index`` (of the list given to
    :func:`directions`): (r, *variable.shape); only direction ``projection`` (in the
    variable's shape) if that is given. ``seeds``: this variable's row of
    :func:`step_seeds` (then ``seed`` is not read), to draw a step's directions with fewer
    graph ops.

    Direction j is ``gaussian.normal(variable.shape, step_seeds(...)[index][j])``: i.i.d.
    N(0, 1) from the step's secret seed."""
    seeds = _variable_seeds(num_projections, seed, index, seeds)
    if projection is not None:
        seeds = seeds[projection:projection + 1]
    alg = tf.constant(randomness.PHILOX, tf.int32)
    out = gaussian.stacked_normals([int(d) for d in variable.shape], seeds, variable.dtype, alg)
    return out[0] if projection is not None else out


def draw_rows(variable, index: int, num_projections: int, seed, num_rows, seeds=None):
    """Directions of a table read by row lookups (an embedding), on the rows a batch looks up
    only: (r, num_rows, width), row m for the batch's m-th distinct id.

    Only looked-up rows enter a projection (``<g_i, v> = sum_t <v[id_it], g_it>``), so a
    direction is needed on those rows alone: O(r B T width) draws instead of O(r rows width)
    (for a 32000-row table, most of JL's time and memory). The rows are drawn together, i.i.d.
    N(0, 1) from the step's secret seed (their own stream, so not the rows of
    :func:`draw`'s direction), and matched to the distinct ids by their order. Whatever the
    ids and their order, the values on the looked-up rows are i.i.d. N(0, 1) and independent
    of the data, the law of a whole direction's restriction to those rows: the projections
    have exactly the law they have with a whole direction, which is what the JL accounting
    assumes. Within a batch each example that looks a row up sees the same vector. Only for
    a step run as one batch on one replica (``one_part_step``, ``rows_only_allowed``):
    parts of a step and replicas share its seed, and there ranks, not ids, would pick the
    vectors.

    Direction j's rows: ``gaussian.normal([num_rows, width], fold_seed(s_j,
    _ROWS_STREAM))`` with ``s_j`` the seed of :func:`draw`'s direction j (``seeds``: as
    for :func:`draw`).
    """
    seeds = _variable_seeds(num_projections, seed, index, seeds)
    alg = tf.constant(randomness.PHILOX, tf.int32)
    shape = tf.stack([tf.cast(num_rows, tf.int32), variable.shape[1]])
    return gaussian.stacked_normals(shape, _rows_seeds(seeds, alg), variable.dtype, alg)


def _rows_seeds(seeds, alg):
    """``[randomness.fold_seed(s, _ROWS_STREAM) for s in seeds]`` (the same numbers: one
    full-range int64 pair drawn from ``(s[0], s[1] XOR _ROWS_STREAM)``), in one XOR for all
    and two raw ops per seed."""
    mixed = tf.bitwise.bitwise_xor(tf.stack([tf.cast(s, tf.int64) for s in seeds]),
                                   tf.constant([[0, _ROWS_STREAM]], tf.int64))  # (k, 2)
    pair = tf.constant([2], tf.int32)
    return [randomness.words_at(key, pair, tf.int64, alg)
            for key in randomness.key_counters(mixed, alg)]


def directions(variables, num_projections: int, seed):
    """r standard Gaussian directions: a list over j of lists over variables.

    ``seed`` is a (2,) int64 tensor (the optimizer's JL stream's seed of the step): the same
    seed gives the same projections. Variable ``i``'s direction ``j`` has seed
    ``step_seeds(r, seed, V)[i][j]``; the JL strategy draws each variable's directions alone (:func:`draw`), the
    same numbers, and an embedding table with ghost factors on its looked-up rows only
    (:func:`draw_rows`).
    """
    seeds = step_seeds(num_projections, seed, len(variables))
    per_variable = [draw(v, i, num_projections, seed, seeds=seeds[i])
                    for i, v in enumerate(variables)]
    return [[d[j] for d in per_variable] for j in range(num_projections)]


def jl_norms(projections):
    """``M_i = sqrt(mean_j P_ij^2)`` from the (r, B) matrix of projections, in float64
    (float32 squares overflow above 1.8e19; the clip factors are formed from these)."""
    p = tf.cast(projections, tf.float64)
    return tf.sqrt(tf.reduce_mean(tf.square(p), axis=0))
