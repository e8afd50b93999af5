"""Rounding-aware per-example norms: every norm comes with an upper bound of what the
weighted sum it describes adds for the example, rounding included.

What bounds an example's contribution is w_i times the norm of its gradient *as the weighted
sum forms it*. So the factors are brought to float32 (float64 for float64 models) before any
norm or sum: float16 Gram entries overflow at 65504 and bfloat16 keeps 8 bits. Every norm
comes with an upper bound that accounts for the rounding of its own computation and of the
sum it describes, from the classical bound for a sum of n terms computed in any order: off
by at most gamma_{n-1} times the sum of their absolute values, gamma_n = n u / (1 - n u)
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed. 2002, Sec. 3.1 and 4.2).
The Gram form sum((A A^T) * (G G^T)) squares the conditioning of sum_t a_t g_t^T: with
kappa = sum_t ||a_t|| ||g_t|| / ||A^T G||, float32 loses kappa^2 u32 of the squared norm (it
even goes negative), so Gram matrices are formed in float64, for one chunk of examples at a
time (float64 copies of whole factors were the step's largest tensors). The rare
examples whose Gram bound exceeds their estimate by more than _NORM_MAX_SLACK (kappa above
~10^4) have their norm from their own float64 matrix, one example at a time.

Weighted sums over examples are formed in float64 (``SUM_DTYPE``), from the float32 factors,
whatever the model's dtype. A float32 sum over examples lets one example change how the
others' terms round: an example whose terms cancel absorbed the low bits of the others' terms
across a block of the float32 product (1.002 C, session 14), and without any cancellation an
example of norm 3e-4 C, pushing a sequential float32 sum of 2048 examples across a power of
two, made 1023 other examples' terms round away: the sum moved by 0.063 C (Casacuberta et al.,
"Widespread underestimation of sensitivity in differentially private libraries and how to
fix it", CCS 2022; ``tests/privacy/float_sum_test.py``). In float64 an example's own share
of the rounding is at most gamma_{2n+2} (float64) times the sum of its terms' sizes, n the
number of terms contracted (``contraction_slack``), which its clip bound includes
(``sum_slack``, ``outright_sum_factor``), and what it can do to the others' rounding is as
small (docs/privacy.md).
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_dp import _internals


def dim_of(t, i):
    """``t``'s dimension ``i``: a Python int when static, else a scalar tensor."""
    return t.shape[i] if t.shape[i] is not None else tf.shape(t)[i]


def flat_per_example(t):
    """(B, ...) -> (B, n), with n static whenever t's non-batch shape is (a -1 would lose it
    when the batch is unknown)."""
    n = t.shape[1:].num_elements() if t.shape.rank is not None else None
    if n:  # static and > 0: the batch is the one -1 (fewer graph ops than tf.shape)
        return t if t.shape.rank == 2 else tf.reshape(t, [-1, n])
    return tf.reshape(t, [tf.shape(t)[0], -1 if n is None else n])


_UNIT_ROUNDOFF = {tf.float16: 2.0**-11, tf.bfloat16: 2.0**-8, tf.float32: 2.0**-24,
                  tf.float64: 2.0**-53}

#: float32 squares are summed in blocks of at most this many (relative error at most
#: gamma_35 = 2.1e-6 of the squared norm), the block sums in float64: a rigorous bound
#: without casting the per-example gradients, often the largest tensors of the step, to
#: float64 (which took 3x as long as this on CPU).
_SQUARES_BLOCK = 32

#: float32 flushes results below its smallest normal number to zero on CPUs.
_FLUSH_FLOAT32 = 2.0**-126


#: The dtype of every sum over examples (weighted sums, micro-batch accumulation, the noise
#: they get): rounded to the variables' dtype once, after the noise (see the module doc).
SUM_DTYPE = tf.float64


def accumulation_dtype(dtype):
    """The dtype of norms' inputs and per-example factors: float64 for float64, else
    float32 (half types are widened: float16 Gram entries overflow at 65504)."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def contraction_slack(terms, size):
    """(B,) float64 or a float: how much a float64 weighted sum of ``terms`` terms can add
    for an example whose terms' sizes sum to ``size``, per unit weight. The sum is formed
    over chunks of examples (``factors.joint_weighted_sums``): within a chunk, in any order,
    the products ``w_i x`` and ``(w_i x) y`` and at most ``terms - 1`` additions; the chunks'
    sums then added in turn, at most ``terms`` more. So every term reaches the result
    through at most 2 terms + 1 roundings (Higham, Sec. 3.1): gamma_{2 terms + 2} (float64)
    times ``size``, with a rounding of its own covered."""
    return gamma(2 * terms + 3, tf.float64) * size


def outright_sum_factor(like):
    """1 + ``contraction_slack(B, 1)`` for a (B,) tensor ``like``: what the float64 sums of
    gradients formed outright (or of one product per entry) can add to an example's own
    terms, as a factor on its norm. Exact bounds (``factors.combined_norms``) and JL
    estimates (``norm_strategies.jl_clip_bounds``) are raised by it."""
    return 1.0 + contraction_slack(tf.cast(tf.shape(like)[0], tf.float64), 1.0)


def computes_in_float16(model) -> bool:
    """Whether a layer of ``model`` computes in float16 (its own policy counts: a wrapper
    made by ``make_private`` outside the policy scope keeps float32 at the model level)."""
    return any(getattr(layer, "compute_dtype", None) == "float16"
               for layer in _internals.all_layers(model))


def unit_roundoff(dtype) -> float:
    """u = 2^-p of a float dtype with p significand bits (round to nearest)."""
    return _UNIT_ROUNDOFF[tf.as_dtype(dtype)]


def gamma(n, dtype):
    """gamma_n = n u / (1 - n u) as float64 (n may be a tensor); inf when n u >= 1/2.

    A Python float (the same float64 arithmetic) when n is a Python int: no graph ops."""
    if isinstance(n, int):
        nu = float(n) * unit_roundoff(dtype)
        return nu / (1.0 - nu) if nu < 0.5 else float("inf")
    nu = tf.cast(n, tf.float64) * unit_roundoff(dtype)
    return tf.where(nu < 0.5, nu / (1.0 - nu), tf.constant(float("inf"), tf.float64))


def _block_size(n):
    """The largest divisor of n that is at most _SQUARES_BLOCK."""
    return next(k for k in range(min(n, _SQUARES_BLOCK), 0, -1) if n % k == 0)


def squared_norms(t):
    """Squared norms of the rows of ``t`` (B, ...) and upper bounds of their exact values.

    Returns (estimate, upper bound), both (B,) float64. float32 rows are summed in float32
    blocks (see ``_SQUARES_BLOCK``); when a square overflows float32 (entries above 1.8e19),
    rows are rescaled by their largest entry first. Rows that hold inf or NaN give inf/NaN.
    """
    flat = flat_per_example(t)
    n = flat.shape[1]
    if flat.dtype == tf.float64 or n is None or n == 0:
        flat = tf.cast(flat, tf.float64)
        sq = tf.reduce_sum(tf.square(flat), axis=1)
        size = n if n is not None else tf.cast(tf.shape(flat)[1], tf.float64)
        return sq, sq * (1.0 + gamma(size + 1, tf.float64)) + size * 2.0**-1022
    flat = tf.cast(flat, tf.float32)
    k = _block_size(n)

    def block_sums(x):
        # One pass over x: TensorFlow's float32 EuclideanNorm is the float32 sum of the
        # block's products x*x (any order) and a square root (kernels/reduction_ops.h), with
        # no (B, n) tensor of squares written and read again (6x faster on (256, 16384)).
        # Squared again here: two more roundings (the root and the square), see ``rel``.
        # XLA has no EuclideanNorm kernel (and fuses a square into its sum itself): there,
        # the plain sum of squares, whose fewer roundings the same bound covers.
        blocks = tf.reshape(x, [-1, n // k, k])
        if _internals.compiling_with_xla():
            return tf.reduce_sum(tf.square(blocks), axis=-1)
        return tf.square(tf.math.reduce_euclidean_norm(blocks, axis=-1))

    q = block_sums(flat)
    # Rows whose squares overflow float32 (rare: entries above 1.8e19) are summed again,
    # rescaled by their largest entry; gathered, without a tf.cond (whose two branch graphs
    # per weight made up most of the private step's tracing).
    overflow = tf.logical_not(tf.reduce_all(tf.math.is_finite(q), axis=1))
    rows = tf.where(overflow)
    sub = tf.gather_nd(flat, rows)
    top = tf.reduce_max(tf.abs(sub), axis=1)
    top = tf.where((top > 0) & tf.math.is_finite(top), top, tf.ones_like(top))
    q_sub = (tf.cast(block_sums(sub / top[:, None]), tf.float64)
             * tf.square(tf.cast(top, tf.float64))[:, None])
    q = tf.tensor_scatter_nd_update(tf.cast(q, tf.float64), rows, q_sub)
    # Per block: a product and k-1 additions of non-negative numbers (s, with every
    # rounding written fl(v) = v / (1 + d), |d| <= u: exact <= s (1 + u)^k), the square root
    # r and its square q (s <= q (1 + u)^3): exact <= q (1 + u)^(k+3) <= q (1 + gamma_(k+3)).
    # Rescaled rows: also a division, and flushed squares lose less than 2^-126 of top^2.
    rel = tf.where(overflow, tf.constant(gamma(k + 4, tf.float32) + n * _FLUSH_FLOAT32,
                                         tf.float64),
                   tf.constant(gamma(k + 3, tf.float32), tf.float64))
    sq = tf.reduce_sum(q, axis=1)
    # n/k block sums in float64. Below float32's smallest normal: a flushed product loses
    # less than 2^-126 (sums of non-negative normals never flush, nor does the root of one);
    # a square q of a root flushed to zero loses s < 2^-126 (1 + u)^2 < 2 * 2^-126.
    rel = rel + gamma(n // k + 1, tf.float64)
    return sq, sq * (1.0 + rel) + (n + 2 * (n // k)) * _FLUSH_FLOAT32


#: One chunk of examples' float64 Gram inputs and matrices (a and g in float64, A A^T, G G^T
#: and their product) takes at most this many bytes (at least one example per chunk): the
#: float64 copies of whole (B, T, d) factors were the largest tensors of the exact step.
_GRAM_CHUNK_BYTES = 16 << 20


def _gram_chunk_examples(steps, d, p):
    """Examples per chunk of ``gram_norms`` (a Python int when the shapes are static)."""
    per_example = 8 * steps * (d + p) + 24 * steps * steps
    if isinstance(per_example, int):
        return max(1, _GRAM_CHUNK_BYTES // max(per_example, 1))
    return tf.maximum(1, _GRAM_CHUNK_BYTES // tf.maximum(per_example, 1))


def _row_norm_bounds(x):
    """(B, T) float64 upper bounds of the norms of the rows ``x[i, t]`` (float32 or float64
    values as stored), from sums of squares in x's own precision (float32 for half types).

    Proof. Let n be the row length, u and lam the unit roundoff and smallest normal number of
    the working precision F. TensorFlow's CPU kernels flush subnormal results to zero and may
    read subnormal inputs as zero, so each operation returns (exact)(1 + delta) + eta with
    |delta| <= u, |eta| < lam (Higham Sec. 2.2 with underflow). The sum of squares s of a row
    (n squares, n - 1 additions in any order, every operand >= 0) satisfies
    s >= (1 - u)^n q' - 2(2n - 1) lam >= (1 - gamma_n) q' - 4n lam, where q' is the exact
    sum of squares of the entries as read (each eta is scaled by at most n factors
    1 + delta <= 1 + gamma_n <= 2). An entry read as zero has |x_i| < lam, so the stored
    row's q <= q' + n lam^2 <= q' + n lam. Hence
        q <= (s + 5 n lam) / (1 - gamma_n)          (the factor is taken as inf if gamma_n > 1/2)
    whenever s is finite: every operand is >= 0, so an overflow anywhere leaves s = inf.
    s is read through TensorFlow's EuclideanNorm (the sum of squares and one square root r,
    in one pass: no (B, T, n) tensor of squares), squared in float64: r = sqrt(s)(1 + delta),
    so s <= r^2 / (1 - u)^2, and r^2 is exact in float64 for float32 r (for float64 r, one
    more rounding): s <= (1 + gamma_3) fl(r^2) either way. XLA, which has no EuclideanNorm
    kernel, sums the squares itself (fused, no tensor of squares either): s directly, which
    the same factor covers.
    Independently, with m the largest |x_i| as read, ||x|| <= sqrt(n) max(m, lam); this one
    holds always (m is exact) and is the tighter one for rows whose squares overflow or
    flush. The result is the smaller of the two. Rows with a NaN give NaN.

    Both are evaluated in float64, each operation monotone on non-negative values with
    relative error <= 2^-53 and no underflow (every bound is 0 or >= 2^-1022): the factor
    (1 + gamma_3) / (1 - gamma_n) is computed with 6 roundings' worth of error (two in each
    gamma, amplified by at most gamma / (1 - gamma) <= 1, one subtraction, one division),
    the argument of the square root with 2 more, the square root halves that and adds one:
    the computed bound is >= (1 - 2^-53)^5 times the exact expression (the max form: 2
    roundings). The caller compensates (``_l1_bound``).
    """
    if x.dtype not in (tf.float32, tf.float64):
        x = tf.cast(x, tf.float32)  # exact: float16 and bfloat16 values are float32 values
    dtype = x.dtype
    lam = 2.0**-126 if dtype == tf.float32 else 2.0**-1022
    n = x.shape[-1] if x.shape[-1] is not None else tf.shape(x)[-1]
    if _internals.compiling_with_xla():
        s = tf.cast(tf.reduce_sum(tf.square(x), axis=-1), tf.float64)
        top = tf.cast(tf.reduce_max(tf.abs(x), axis=-1), tf.float64)
    else:
        r = tf.cast(tf.math.reduce_euclidean_norm(x, axis=-1), tf.float64)
        s = r * r
        # max |x_i| without a (B, T, n) tensor of absolute values.
        top = tf.cast(tf.maximum(tf.reduce_max(x, axis=-1), -tf.reduce_min(x, axis=-1)),
                      tf.float64)
    g = gamma(n, dtype)
    root = 1.0 + gamma(3, dtype)
    if isinstance(n, int):
        widen = 1.0 / (1.0 - g) if g <= 0.5 else float("inf")
        by_sum = tf.sqrt((s * root + 5.0 * n * lam) * widen)
        by_max = math.sqrt(n) * tf.maximum(top, lam)
    else:
        small = g <= 0.5
        widen = tf.where(small, 1.0 / (1.0 - tf.where(small, g, 0.0)),
                         tf.constant(float("inf"), tf.float64))
        n64 = tf.cast(n, tf.float64)
        by_sum = tf.sqrt((s * root + 5.0 * n64 * lam) * widen)
        by_max = tf.sqrt(n64) * tf.maximum(top, lam)
    bound = tf.where(tf.math.is_finite(s), tf.minimum(by_sum, by_max), by_max)
    return tf.where(tf.math.is_nan(s), s, bound)


def _l1_bound(a, g):
    """An upper bound of l1 = sum_t ||a_t|| ||g_t|| per example, (B,) float64, from float32
    row norms of the whole batch (no float64 copy of a factor; (B, T) in float64)."""
    # l1 <= sum_t A_t G_t, A_t and G_t the exact values of the row bounds, which
    # _row_norm_bounds computes to within (1 - u)^5 each (u = 2^-53). With the product and
    # the T - 1 additions, the computed sum is >= (1 - u)^(T + 10) sum_t A_t G_t, minus what
    # flushes: a float64 result below 2^-1022 (float64 factors below ~1e-154 only) loses less
    # than 2^-1022, at most 2T of them, each scaled later by at most (1 + gamma_T) <= 2: less
    # than 4T 2^-1022 in all, which is added back (one rounding). The factor
    # c = 1 + 2 gamma_{T+32} is computed with 3 roundings and applied with one: the result is
    # >= (1 - u)^(T + 15) (1 + 2 gamma_{T+32}) l1 >= (1 - gamma_{T+15}) (1 + 2 gamma_{T+32})
    # l1 >= l1.
    steps = a.shape[1] if a.shape[1] is not None else tf.shape(a)[1]
    products = tf.reduce_sum(_row_norm_bounds(a) * _row_norm_bounds(g), axis=1)
    flushed = 4.0 * (steps if isinstance(steps, int) else tf.cast(steps, tf.float64)) * 2.0**-1022
    return (products + flushed) * (1.0 + 2.0 * gamma(steps + 32, tf.float64))


def _gram_sums(a, g):
    """sum((A A^T) * (G G^T)) per example of one chunk, (n,) float64: only this chunk's
    float64 copies of the factors exist while it runs."""
    a64, g64 = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    aa = tf.einsum("btd,bsd->bts", a64, a64)
    gg = tf.einsum("btp,bsp->bts", g64, g64)
    return tf.reduce_sum(aa * gg, axis=[1, 2])


def gram_norms(a, g):
    """``||sum_t a_t g_t^T||^2`` from float64 Gram matrices, with a bound, per example.

    Returns (estimate clamped to [0, l1^2], upper bound, l1), all (B,) float64, where ``l1``
    is an upper bound of ``sum_t ||a_t|| ||g_t||``, which bounds both the norm and the size
    of every rounding error. The float64 Gram matrices are formed over chunks of examples
    (``_GRAM_CHUNK_BYTES`` each, one chunk at a time), so the float64 copies of the factors
    exist for one chunk, not for the whole batch; ``l1`` comes from float32 row norms with
    their rounding bounded (``_row_norm_bounds``), for the whole batch at once.
    ``joint_gram_norms`` does the same for several weights in one loop.
    """
    return joint_gram_norms([(a, g)])[0]


def joint_gram_norms(pairs):
    """``gram_norms`` of every (a, g) in ``pairs``: one loop over chunks of examples for all
    of them (a loop per weight was ~0.1 s each of the step's first call: 24 of them in the
    11.4M Transformer), the weights one after the other inside it (control dependencies:
    one weight's float64 copies of one chunk at a time), chunks of the smallest of their
    ``_gram_chunk_examples``. Per example, the same numbers as one weight alone."""
    if not pairs:
        return []
    dims = [(dim_of(a, 1), dim_of(a, 2), dim_of(g, 2)) for a, g in pairs]
    chunks = [_gram_chunk_examples(*d) for d in dims]
    chunk = (min(chunks) if all(isinstance(c, int) for c in chunks)
             else tf.reduce_min(tf.stack([tf.cast(c, tf.int32) for c in chunks])))
    batch = pairs[0][0].shape[0]
    if batch is not None and isinstance(chunk, int) and batch <= chunk:
        sums = _in_order([lambda a=a, g=g: _gram_sums(a, g) for a, g in pairs])
    else:
        sums = _chunked(pairs, chunk)
    out = []
    for (a, g), (steps, d, p), s in zip(pairs, dims, sums):
        l1 = _l1_bound(a, g)
        l1_sq = tf.square(l1)
        # Each Gram entry is off by gamma_d (gamma_p) times ||a_t|| ||a_s|| (||g_t|| ||g_s||),
        # the T^2 products are summed: the error is at most gamma_{d+p+T^2+2} sum_ts ||a_t||
        # ||a_s|| ||g_t|| ||g_s|| <= gamma l1^2 (l1 bounds the exact sum); the rest covers
        # l1^2's rounding. (Python numbers when the shapes are static: no graph ops.)
        rel = gamma(d + p + steps * steps + steps + 8, tf.float64)
        sq = tf.clip_by_value(s, tf.zeros_like(s), l1_sq)
        upper = tf.minimum(tf.maximum(s, 0.0) + 2.0 * rel * l1_sq, (1.0 + 3.0 * rel) * l1_sq)
        out.append((sq, upper, l1))
    return out


def _in_order(fns):
    """``[fn() for fn in fns]``, each formed after the previous one's result exists (so the
    temporaries of one are freed before the next one's are made)."""
    out = []
    for fn in fns:
        with tf.control_dependencies(out[-1:]):
            out.append(fn())
    return out


def _chunked(pairs, chunk):
    """``_gram_sums`` of every pair over the batch, one chunk of at most ``chunk`` examples
    at a time in ONE sequential loop. Works for an unknown batch and for B = 0.

    The last chunk is the remaining B mod chunk examples, in the same loop (one loop body in
    the graph: the step's first call instantiates and optimises every loop). XLA needs
    static shapes: there, floor(B / chunk) chunks of ``chunk`` examples in the loop and the
    rest after it."""
    batch = tf.shape(pairs[0][0])[0]
    k = len(pairs)

    def sums_of(start, size):
        return _in_order([
            lambda a=a, g=g: _gram_sums(tf.slice(a, tf.stack([start, 0, 0]), size),
                                        tf.slice(g, tf.stack([start, 0, 0]), size))
            for a, g in pairs])

    if _internals.compiling_with_xla():
        full = batch // chunk
        # XLA checks the body's slice against the batch even when the loop runs 0 times: a
        # batch smaller than a chunk (fit's Poisson batches) failed to compile with a chunk
        # of `chunk` rows. min(chunk, B) is `chunk` whenever the loop runs.
        width = tf.minimum(chunk, batch)
        # At least one row and one column: XLA also refuses a scatter into an empty buffer,
        # and it compiles the loop for an empty batch too (B = 0 is a static shape of its
        # own; the empty-batch tf.cond around the step does not spare the branch it skips).
        # The body's sums are padded to the buffer's width, by 0 whenever the loop runs.
        padded = tf.maximum(width, 1)

        def body(i, bufs):
            parts = sums_of(i * width, tf.stack([width, -1, -1]))
            return i + 1, tuple(
                tf.tensor_scatter_nd_update(b, [[i]], tf.pad(s, [[0, padded - width]])[None])
                for b, s in zip(bufs, parts))

        _, bufs = tf.while_loop(
            lambda i, _: i < full, body,
            (0, (tf.zeros(tf.stack([tf.maximum(full, 1), padded]), tf.float64),) * k),
            parallel_iterations=1, maximum_iterations=full)
        done = [tf.reshape(b[:full], [-1]) for b in bufs]
        with tf.control_dependencies(done):  # one chunk's float64 copies at a time
            rest = _in_order([lambda a=a, g=g: _gram_sums(a[full * chunk:], g[full * chunk:])
                              for a, g in pairs])
        return [tf.concat([x, y], 0) for x, y in zip(done, rest)]

    count = (batch + chunk - 1) // chunk

    def body(i, bufs):
        start = i * chunk
        size = tf.minimum(chunk, batch - start)
        rows = tf.range(start, start + size)[:, None]
        parts = sums_of(start, tf.stack([size, -1, -1]))
        return i + 1, tuple(tf.tensor_scatter_nd_update(b, rows, s)
                            for b, s in zip(bufs, parts))

    _, bufs = tf.while_loop(lambda i, _: i < count, body,
                            (0, (tf.zeros(tf.reshape(batch, [1]), tf.float64),) * k),
                            parallel_iterations=1, maximum_iterations=count)
    return list(bufs)


def exact_outer_norms(a, g, l1):
    """Squared norms of ``sum_t a_t g_t^T`` from the float64 matrices, one example at a time
    (d x p memory, not B of them), and upper bounds of the exact norms, (n,) float64.

    The matrix is off by at most gamma_T l1 (float64), its sum of squares by gamma_{dp}.
    """
    return joint_exact_outer_norms([(a, g, l1, tf.range(tf.shape(a)[0]))])[0]


def joint_exact_outer_norms(items):
    """``exact_outer_norms`` of the examples ``rows`` (n_k,) of each (a, g, l1, rows) in
    ``items``: ONE loop over k < max n_k for all of them, where each weight forms the float64
    matrix of its k-th example one after the other (one d x p matrix at a time); a weight
    with fewer examples takes an empty slice (no work) in the remaining iterations.
    Returns [(squared norms (n_k,), bounds (n_k,))]."""
    if not items:
        return []
    counts = [tf.shape(rows)[0] for _, _, _, rows in items]

    def entry(k, m):
        a, g, _, rows = items[m]
        n = counts[m]
        j = tf.minimum(k, n)  # n: the spare slot of the buffer
        i = tf.gather(tf.concat([tf.cast(rows, tf.int32), [0]], 0), j)
        # an example beyond this weight's n: a zero-width slice (no work)
        width = tf.where(k < n, tf.shape(a)[2], 0)
        a_i = tf.slice(a, tf.stack([i, 0, 0]), tf.stack([1, -1, width]))[0]
        return j, _square_norm64(a_i, g[i])

    bufs = _fill_in_order(tf.reduce_max(tf.stack(counts)), [n + 1 for n in counts], entry)
    return [(buf[:n], _exact_outer_bound(a, g, buf[:n], tf.gather(l1, rows)))
            for (a, g, l1, rows), n, buf in zip(items, counts, bufs)]


def _fill_in_order(count, sizes, entry):
    """float64 buffers of ``sizes`` filled by ONE sequential loop over k < count: in each
    iteration buffer m gets ``value`` at ``slot`` for ``(slot, value) = entry(k, m)``, the
    buffers one after the other (each entry waits for the previous one's value: one
    float64 matrix alive at a time)."""
    def body(k, bufs):
        out, last = [], []
        for m, buf in enumerate(bufs):
            with tf.control_dependencies(last):
                slot, value = entry(k, m)
            last = [value]
            out.append(tf.tensor_scatter_nd_update(buf, tf.reshape(slot, [1, 1]),
                                                   tf.reshape(value, [1])))
        return k + 1, tuple(out)

    # At least one entry each: a scatter into an empty buffer fails to build for a static
    # empty batch (XLA compiles the loop for B = 0 too, though it runs 0 times).
    _, bufs = tf.while_loop(
        lambda k, _: k < count, body,
        (tf.constant(0), tuple(tf.zeros(tf.reshape(tf.maximum(n, 1), [1]), tf.float64)
                               for n in sizes)),
        parallel_iterations=1)
    return [buf[:n] for buf, n in zip(bufs, sizes)]


def _square_norm64(a_i, g_i):
    """||a_i^T g_i||^2 of one example's (T, d) and (T, p) factors, from its float64 matrix."""
    return tf.reduce_sum(tf.square(tf.matmul(tf.cast(a_i, tf.float64), tf.cast(g_i, tf.float64),
                                             transpose_a=True)))


def _exact_outer_bound(a, g, sq, l1):
    """Upper bounds of the exact norms from float64 squared norms ``sq`` of d x p matrices
    (their own rounding) plus the float32 factors' recorded-term slack (``l1``)."""
    size = dim_of(a, 2) * dim_of(g, 2)
    return (tf.sqrt(sq) * (1.0 + gamma(size + 2, tf.float64))
            + gamma(dim_of(a, 1), tf.float64) * l1)


def masked_exact_outer_norms(items):
    """``joint_exact_outer_norms`` in static shapes, for XLA: items (a, g, l1, wide) with
    ``wide`` (B,) bool; ONE loop over the B examples, where each weight forms the float64
    matrix of example k only if it is wide (a ``tf.cond``). Under XLA the loop above does
    not compile (its buffers' and slices' sizes depend on how many examples are wide).
    Returns [(squared norms (B,), bounds (B,))], 0 for examples that are not wide."""
    if not items:
        return []
    batch = tf.shape(items[0][0])[0]
    # One zero row past the batch: XLA compiles the loop body for an empty batch too (B = 0
    # is a static shape of its own, though the loop then runs 0 times), and refuses a row
    # slice of an empty axis. Row k < B never reads it.
    padded = [tuple(tf.pad(t, [[0, 1]] + [[0, 0]] * (t.shape.rank - 1))
                    for t in (item[0], item[1], item[3])) for item in items]

    def entry(k, m):
        a, g, wide = padded[m]
        return k, tf.cond(wide[k], lambda: _square_norm64(a[k], g[k]),
                          lambda: tf.zeros([], tf.float64))

    bufs = _fill_in_order(batch, [batch] * len(items), entry)
    return [(sq, _exact_outer_bound(a, g, sq, l1)) for (a, g, l1, _), sq in zip(items, bufs)]


#: An example whose norm bound exceeds its estimate by more than this fraction (an
#: ill-conditioned gradient: terms far larger than their sum, so that the rounding of a
#: float32 norm computation could be that large) has its norm formed in float64 instead: the
#: bound would lower its clip factor by that much.
_NORM_MAX_SLACK = 1e-4


def ill_conditioned(norm_bound, slack):
    """(B,) bool: ``slack`` is above ``_NORM_MAX_SLACK`` of the norm."""
    return slack > _NORM_MAX_SLACK * norm_bound


def _rows_of(ids):
    """The distinct (example, id) rows of ``ids`` (B, T): (row of every token (B*T,) int32,
    number of rows, example of every row, row keys ``example * width + id``, width). A hash
    of B*T keys: linear in the tokens (the (B, T, T) comparison of equal ids grew as T^2)."""
    ids = tf.cast(ids, tf.int64)
    batch, steps = tf.shape(ids, out_type=tf.int64)[0], tf.shape(ids, out_type=tf.int64)[1]
    width = tf.maximum(tf.reduce_max(ids), 0) + 1  # ids are >= 0 (they index a table)
    example = tf.repeat(tf.range(batch), steps)
    keys, row = tf.unique(tf.reshape(ids, [-1]) + example * width, out_idx=tf.int32)
    return row, tf.size(keys), tf.cast(keys // width, tf.int32), keys, width


def _rows_norm(g_flat, row, num_rows, example_of_row, batch):
    """(estimate, upper bound) per example of ``sqrt(sum_rows ||R||^2)``, ``R`` the sum of
    the ``g_flat`` (B*T, D) of one row: the norm of the per-example embedding gradient."""
    sums = tf.math.unsorted_segment_sum(g_flat, row, num_rows)
    r_sq, r_upper = squared_norms(sums)
    return (tf.math.unsorted_segment_sum(r_sq, example_of_row, batch),
            tf.sqrt(tf.math.unsorted_segment_sum(r_upper, example_of_row, batch)))


def _width(t):
    """t's last axis for a reshape, static when known (squared_norms needs a static width)."""
    return t.shape[-1] if t.shape[-1] is not None else -1


def _rows_spread(g_flat, row, num_rows, example_of_row, batch):
    """(B,) float64: ``spread_i = sqrt(sum over example i's rows of (sum_{s in row}
    ||g_s||)^2)``, summed in g's dtype (``_spread_rounding`` covers that): the rounding of a
    row sum of example i's tokens is at most gamma times its row's sum of norms."""
    _, g_sq = squared_norms(g_flat)
    near = tf.cast(tf.math.unsorted_segment_sum(tf.cast(tf.sqrt(g_sq), g_flat.dtype), row,
                                                num_rows), tf.float64)
    return tf.sqrt(tf.math.unsorted_segment_sum(tf.square(near), example_of_row, batch))


def _spread_rounding(dtype, steps):
    """The factor that covers ``_rows_spread``'s own rounding in ``dtype``."""
    return 1.0 + gamma(steps + 4, dtype)


def _table_sum_slack(spread, batch, steps):
    """(B,) float64: how much the float64 segment sum of the batch's ``w_i g_s`` into the
    table rows can add for an example beyond its exact rows, per unit weight: a row of the
    table sums at most B*T terms, in any order (``contraction_slack``)."""
    terms = tf.cast(batch, tf.float64) * tf.cast(steps, tf.float64)
    return contraction_slack(terms, spread)


def embedding_sum_slack(ids, g):
    """(B,) float64: how much the float64 segment sum of the weighted sum can differ, per
    unit weight, from the exact sum of an example's factors as recorded. JL norms need it
    (``outer_sum_slack``)."""
    batch = tf.shape(g)[0]
    steps = g.shape[1] if g.shape[1] is not None else tf.shape(g)[1]
    g_flat = tf.reshape(g, [-1, _width(g)])
    row, num_rows, example_of_row, _, _ = _rows_of(ids)
    spread = _rows_spread(g_flat, row, num_rows, example_of_row, batch)
    return _table_sum_slack(spread * _spread_rounding(g.dtype, steps), batch, steps)


def outer_sum_slack(a, g):
    """(B,) float64: how much the float64 weighted sum ``sum_{i,t} (w_i a_it) g_it^T`` can
    differ for example i, per unit weight, from the exact ``sum_t a_it g_it^T`` of its
    recorded factors: the B*T terms in any order (``contraction_slack``) times
    ``l1 = sum_t ||a_it|| ||g_it||`` (``_l1_bound``, from float32 row norms).

    An estimate of the exact gradient's norm (JL's) does not see this rounding, and when an
    example's terms cancel (huge factors, a tiny gradient) it is all there is: JL clip bounds
    are kept above it / ``JL_ROUNDING_SLACK`` (``tf_dp.core.norm_strategies.JL``)."""
    terms = tf.cast(tf.shape(a)[0], tf.float64) * tf.cast(dim_of(a, 1), tf.float64)
    return contraction_slack(terms, _l1_bound(a, g))


def embedding_norms(ids, g):
    """Norms of the per-example embedding gradients (rows ``ids[i, t]`` receive ``g[i, t]``).

    The row sums ``R`` of every distinct (example, id) are formed by one segment sum (linear
    in B*T*D), and ``||grad_i||^2 = sum over example i's rows of ||R||^2``: a sum of squares,
    which cannot cancel. The float32 row sums are off by at most gamma_{T+1} spread (their
    terms may cancel); examples for which that is above ``_NORM_MAX_SLACK`` of the norm have
    their row sums formed again in float64.

    Returns (squared norm, upper bound of the norm of what ``weighted_sum`` adds per unit
    weight, (B,) bool of the examples whose norms are formed in float64 (None for float64
    g)).
    """
    batch = tf.shape(g)[0]
    steps = g.shape[1] if g.shape[1] is not None else tf.shape(g)[1]
    width = _width(g)
    g_flat = tf.reshape(g, [-1, width])
    row, num_rows, example_of_row, keys, key_width = _rows_of(ids)
    sq, upper = _rows_norm(g_flat, row, num_rows, example_of_row, batch)
    spread = (_rows_spread(g_flat, row, num_rows, example_of_row, batch)
              * _spread_rounding(g.dtype, steps))
    sum_slack = _table_sum_slack(spread, batch, steps)
    if g.dtype == tf.float64:
        return sq, upper + gamma(steps + 1, tf.float64) * spread + sum_slack, None
    norm_slack = gamma(steps + 1, g.dtype) * spread
    wide = ill_conditioned(upper, norm_slack)
    if _internals.compiling_with_xla():
        # XLA pads the dynamic-size results of tf.where and tf.unique below to B*T entries
        # and sums the padding (copies of token 0) into example 0's rows: example 0's norm
        # then grew with the number of other tokens in the batch, and one example moved the
        # clipped sum by 1.76 C (session 18 audit, tests/privacy/clip_bound_test.py). Static
        # shapes here: every token's row sum again in float64, other examples' tokens zeroed
        # (their float64 norms are not used).
        tokens = tf.reshape(tf.repeat(wide, steps), [-1, 1])
        g64 = tf.where(tokens, tf.cast(g_flat, tf.float64), tf.zeros([], tf.float64))
        sq64, upper64 = _rows_norm(g64, row, num_rows, example_of_row, batch)
    else:
        # Ill-conditioned examples: row sums again in float64, for their tokens only.
        tokens = tf.where(tf.repeat(wide, steps))[:, 0]
        sub_keys, sub_row = tf.unique(tf.gather(keys, tf.gather(row, tokens)),
                                      out_idx=tf.int32)
        sq64, upper64 = _rows_norm(tf.cast(tf.gather(g_flat, tokens), tf.float64), sub_row,
                                   tf.size(sub_keys), tf.cast(sub_keys // key_width, tf.int32),
                                   batch)
    sq = tf.where(wide, sq64, sq)
    upper = tf.where(wide, upper64, upper)
    norm_slack = tf.where(wide, gamma(steps + 1, tf.float64) * spread, norm_slack)
    return sq, upper + norm_slack + sum_slack, wide


def materialised_norms(per):
    """(squared norm, norm bound) of materialised per-example gradients ``per`` (B, ...).

    The weighted sum adds ``w_i * per_i`` itself: the bound is that of the norm's own
    rounding (the products ``w_i per_i`` are the final products, see ``clip_factors``).
    """
    sq, upper = squared_norms(per)
    return sq, tf.sqrt(upper)


def drop_examples(x, w):
    """``x`` with the examples of weight 0 zeroed, even where ``x`` is inf or NaN."""
    keep = tf.reshape(w > 0, [-1] + [1] * (x.shape.rank - 1))
    return tf.where(keep, x, tf.zeros_like(x))


def weighted_per_example_sum(w, per):
    """``sum_i w_i per_i`` of materialised per-example gradients ``per`` (B, ...), in
    ``SUM_DTYPE`` (float64; see the module doc: in float32 one example could make the others
    round away). Examples of weight 0 whose gradient is inf or NaN make it NaN (0 * inf):
    ``factors.joint_weighted_sums(sanitize=)`` zeroes them first when a bound says so.
    """
    per = tf.cast(per, SUM_DTYPE)
    if per.shape.rank == 2:
        # (1, B) x (B, n): a 2-D MatMul whatever the shapes' static knowledge (matvec's
        # product became a BatchMatMulV2 on chunks read from a TensorList, 4x slower).
        return tf.matmul(tf.reshape(tf.cast(w, SUM_DTYPE), [1, -1]), per)[0]
    return tf.tensordot(tf.cast(w, SUM_DTYPE), per, axes=1)
