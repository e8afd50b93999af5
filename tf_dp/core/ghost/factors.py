"""Per-weight factors: a weight's per-example norms, JL projections and clipped sum.

``factors_for`` turns the terms a capture recorded for one weight (``terms.py``) into one
object with the same interface whatever the layer:

* ``sq``, ``bound``: (B,) float64 squared norms and an upper bound of the norm of what
  ``weighted_sum`` adds per unit weight, rounding included (exact strategies only);
* ``project(directions)``: ``<g_i, v_j>`` for JL directions (r, *shape) -> (r, B);
* ``dependencies()``: the tensors that hold them (a JL strategy draws the weight's directions
  after these exist, so not every weight's directions are alive at once);
* ``weighted_sum(w)``: ``sum_i w_i g_i`` in the weight's shape.

Variants are subclasses: ``OuterFactors`` (ghost Gram norms or materialised products),
``EmbeddingFactors`` (row sums of equal token ids) and ``MaterialisedFactors`` (a
per-example gradient formed outright: direct terms, mixed uses, the vectorized fallback).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_dp import _internals
from tf_dp.core.ghost import precision
from tf_dp.core.ghost.precision import gamma
from tf_dp.core.ghost.terms import EmbeddingTerm, OuterTerm


@dataclasses.dataclass(frozen=True)
class FactorOptions:
    """How factors are formed.

    exact_norms: form ``sq`` and ``bound`` (False for JL norms: only projections are used).
    num_projections: r, for the choice between projecting factors and materialising.

    (Examples of weight 0 whose factors are inf or NaN are zeroed by the sums themselves,
    when told to: ``joint_weighted_sums(sanitize=)``.)
    """

    exact_norms: bool = True
    num_projections: int = 1


class Factors:
    """One weight's per-example gradients in whatever form is cheapest (see module doc)."""

    sq = None
    bound = None

    def __init__(self, variable, options: FactorOptions):
        self.variable = variable
        self.options = options

    def project(self, directions):
        """``P[j, i] = <g_i, v_j>`` for directions (r, *variable.shape) -> (r, B)."""
        raise NotImplementedError

    def dependencies(self):
        """The tensors these factors are formed from (their per-example gradients)."""
        raise NotImplementedError

    def sum_slack(self):
        """(B,) float64 or None: how much ``weighted_sum`` can add for an example, per unit
        weight, beyond the exact sum of its recorded factors (rounding), when its terms may
        cancel (None: the sum adds each example's gradient as formed, or one product per
        entry; ``combined_norms`` covers their float64 rounding). Exact norms include it in
        ``bound``; JL clip bounds are kept above it (``norm_strategies.JL``)."""
        return None

    def weighted_sum(self, w):
        """``sum_i w_i g_i`` in the variable's shape, in ``precision.SUM_DTYPE`` (float64):
        every sum over examples is formed in float64 from the factors (precision.py's module
        doc says why); ``w`` is applied in float64 too. ``joint_weighted_sums`` forms several
        weights' in one loop over chunks of examples."""
        return joint_weighted_sums([self], [w])[0]

    def sum_parts(self):
        """(per-example tensors, ``fn(w, *tensors)`` -> the float64 sum of those examples in
        the variable's shape, float64 bytes ``fn`` makes per example) when the weighted sum
        can be formed over chunks of examples and added up (``joint_weighted_sums``), or
        None when it is formed at once (``whole_sum``)."""
        return None

    def whole_sum(self, w, sanitize=None):
        """The weighted sum formed at once (factors without ``sum_parts``). ``sanitize``:
        None, or a scalar bool tensor; when it holds, the examples of weight 0 are zeroed
        first (``joint_weighted_sums``)."""
        raise NotImplementedError


class MaterialisedFactors(Factors):
    """Per-example gradients ``per`` (B, ...) formed outright. ``sq`` and ``bound`` are
    formed when first read (exact strategies only): small ones together, see
    ``combined_norms``."""

    _norms = None

    def __init__(self, variable, per, options: FactorOptions):
        super().__init__(variable, options)
        self.per = per

    @property
    def sq(self):
        return self._own_norms()[0]

    @property
    def bound(self):
        return self._own_norms()[1]

    def _own_norms(self):
        if not self.options.exact_norms:
            return None, None
        if self._norms is None:
            self._norms = precision.materialised_norms(self.per)
        return self._norms

    def dependencies(self):
        return [self.per]

    def project(self, directions):
        r = directions.shape[0]
        v = tf.reshape(tf.cast(directions, self.per.dtype), [r, -1])
        return tf.matmul(v, precision.flat_per_example(self.per), transpose_b=True)

    def sum_parts(self):
        flat = precision.flat_per_example(self.per)
        shape = self.variable.shape

        def fn(w, per):
            return tf.reshape(precision.weighted_per_example_sum(w, per), shape)

        return [flat], fn, _float64_bytes(flat)


#: per-example gradients of at most this many entries may always be materialised for exact
#: norms when that takes fewer flops (larger ones only when they take no more memory than
#: the Gram matrices).
_MATERIALISE_NORMS_MAX_ENTRIES = 1 << 15


def _use_ghost(a, g):
    """Ghost (float64 Gram matrices, B*T^2*(d+p), then the weighted sum from the factors,
    B*T*d*p) vs materialised (B*T*d*p once, then B*d*p), by static shapes; when T is
    unknown, materialised for small per-example gradients (see below).

    Measured on CPU (docs/step_time.md), a float64 Gram product costs about twice a float32
    one and the batched per-example product about twice the single product of the weighted
    sum, so materialising is cheaper when d*p <= 4T(d + p); it is chosen then if its memory
    is small or no larger than the Gram matrices', and always when T^2 > d*p.
    """
    t, d, p = a.shape[1], a.shape[-1], g.shape[-1]
    if d is None or p is None:
        return True
    if t is None:
        # A length unknown while tracing (declared None: hidden in every step): materialise
        # the small per-example gradients, whose memory does not grow with T, as a long
        # sequence would (the Gram form made a BiLSTM's step 4.2x non-private instead of
        # 1.2x at T = 150, docs/step_time.md); by the layer's sizes alone, never the data's.
        return d * p > _MATERIALISE_NORMS_MAX_ENTRIES
    if t * t > d * p:
        return False
    cheaper = d * p <= 4 * t * (d + p)
    return not (cheaper and d * p <= max(_MATERIALISE_NORMS_MAX_ENTRIES, 4 * t * t))


#: per-example gradients of at most this many entries per example may be materialised for
#: JL projections even when they take more memory than the factors they replace.
_MATERIALISE_SMALL_ENTRIES = 1 << 12


def _materialise_for_projection(a, g, num_projections):
    """JL projections of an outer-product term: materialise the per-example gradient
    (B, d, p) whenever there are at least two positions and its memory is small or no
    larger than the factors (B, T, d + p) it replaces (it is kept for the weighted sum, they
    are not).

    Flops: materialising is B*T*d*p once, then r*B*d*p for the projections and B*d*p for the
    weighted sum; projecting the factors is r*B*T*(d*p + min(d, p)), and the weighted sum
    from the factors another B*T*d*p. So materialising is cheaper for every r >= 1 once
    T >= 2 ((r + 1) d p <= r T d p). (The rule once left out the weighted sum and projected
    for r = 1: the BiLSTM's JL r = 1 step paid a second B*T*d*p per kernel and was slower
    than r = 5, docs/step_time.md.) The factors are projected one direction at a time (one
    (B, T, min(d, p)) tensor alive), so r does not scale the memory of the alternative."""
    del num_projections  # the choice is the same for every r (see above)
    t, d, p = a.shape[1], a.shape[-1], g.shape[-1]
    if d is None or p is None:
        return False
    if t is None:  # a length unknown while tracing: by the layer's sizes, as _use_ghost
        return d * p <= _MATERIALISE_NORMS_MAX_ENTRIES
    if t < 2:
        return False
    return d * p <= max(_MATERIALISE_SMALL_ENTRIES, t * (d + p))


def _concat_factors(terms, dz_of):
    fac = [t.factors(dz_of(t)) for t in terms]
    if len(fac) == 1:
        return fac[0]
    return tf.concat([f[0] for f in fac], axis=1), tf.concat([f[1] for f in fac], axis=1)


class OuterFactors(Factors):
    """``g_i = sum_t a_it (outer) g_it``: norms from float64 Gram matrices (B*T^2) or from
    the materialised product (B*d*p), whichever is cheaper (Goodfellow 2015; Li et al. 2022,
    "Large language models can be strong differentially private learners", Sec. 4); the
    clipped sum from the same factors (Bu et al. 2022, "book-keeping")."""

    def __init__(self, variable, a, g, options: FactorOptions):
        super().__init__(variable, options)
        self.a, self.g = a, g
        self.per = None
        self._wide = None  # (B,) bool: examples whose norms are formed one at a time
        self._sq = self._bound = None
        # Gram norms are formed on first read, together with every other weight's that
        # combined_norms reads (form_gram_norms: one loop for all).
        self._gram_pending = False
        if options.exact_norms and a.shape[1] == 1:
            self._rank_one_norms()
        elif options.exact_norms and _use_ghost(a, g):
            self._gram_pending = True
        elif options.exact_norms or _materialise_for_projection(a, g,
                                                                options.num_projections):
            self.per = tf.einsum("btd,btp->bdp", a, g)
            if options.exact_norms:
                self._sq, self._bound = precision.materialised_norms(self.per)
            else:
                self.a = self.g = None  # nothing reads them again: eager mode frees them

    def _rank_one_norms(self):
        # One position (a Dense layer on (B, d) inputs): g_i = a_i g_i^T has norm exactly
        # ||a_i|| ||g_i|| (no Gram matrix, nothing cancels), and every entry of the weighted
        # sum is a single product per example (the final products of clip_factors' bound).
        # (B, d) and (B, p) are small: their squares in float64, exact to ~1e-16.
        sq_a, upper_a = precision.squared_norms(tf.cast(self.a[:, 0, :], tf.float64))
        sq_g, upper_g = precision.squared_norms(tf.cast(self.g[:, 0, :], tf.float64))
        self._sq = sq_a * sq_g
        # Two float64 roundings (the product and the square root) on top of the bounds.
        self._bound = tf.sqrt(upper_a * upper_g) * (1.0 + gamma(2, tf.float64))

    @property
    def sq(self):
        form_gram_norms([self])
        return self._sq

    @property
    def bound(self):
        form_gram_norms([self])
        return self._bound

    @property
    def wide(self):
        form_gram_norms([self])
        return self._wide

    def dependencies(self):
        return [self.per] if self.per is not None else [self.a, self.g]

    def sum_slack(self):
        if self.per is not None or self.a.shape[1] == 1:
            return None  # materialised, or one product per example in each entry
        return precision.outer_sum_slack(self.a, self.g)

    def project(self, directions):
        if self.per is not None:
            return MaterialisedFactors.project(self, directions)
        # One direction at a time: the peak is one projected factor, not r of them.
        r, d, p = directions.shape[0], self.a.shape[-1], self.g.shape[-1]
        v = tf.reshape(tf.cast(directions, self.a.dtype), [r, d, p])
        if p <= d:
            return tf.stack([tf.einsum("btp,btp->b", tf.einsum("btd,dp->btp", self.a, v[j]),
                                       self.g) for j in range(r)])
        return tf.stack([tf.einsum("btd,btd->b", tf.einsum("btp,dp->btd", self.g, v[j]),
                                   self.a) for j in range(r)])

    def sum_parts(self):
        if self.per is not None:
            return MaterialisedFactors.sum_parts(self)
        shape = self.variable.shape

        def fn(w, a, g):
            # In float64 (module doc of precision.py): the float32 product's blocked order
            # let an example whose terms cancel absorb the others' low bits (1.002 C).
            f64 = precision.SUM_DTYPE
            out = tf.einsum("btd,btp->dp", tf.cast(a, f64) * tf.cast(w, f64)[:, None, None],
                            tf.cast(g, f64))
            return tf.reshape(out, shape)

        return [self.a, self.g], fn, _float64_bytes(self.a, self.g)


def form_gram_norms(factors):
    """Forms the Gram norms of every ``OuterFactors`` in ``factors`` that waits for them,
    together: one loop over chunks of examples for all their Gram matrices, one loop over
    their ill-conditioned examples (``precision.joint_gram_norms``,
    ``joint_exact_outer_norms``; two loops per weight were most of the 11.4M Transformer's
    first call beyond non-private's). Per weight, the same numbers as alone."""
    pending = [f for f in factors if isinstance(f, OuterFactors) and f._gram_pending]
    if not pending:
        return
    for f in pending:
        f._gram_pending = False
    stats = precision.joint_gram_norms([(f.a, f.g) for f in pending])
    exact = []
    for f, (sq, upper, l1) in zip(pending, stats):
        # The float64 weighted sum's own rounding for example i: its B*T terms in any order
        # carry at most gamma_{BT+2} w_i l1_i (precision.contraction_slack).
        terms = tf.cast(tf.shape(f.a)[0], tf.float64) * tf.cast(precision.dim_of(f.a, 1),
                                                               tf.float64)
        slack = precision.contraction_slack(terms, l1)
        norm = tf.sqrt(upper)
        # The Gram form loses up to kappa^2 of float64's precision: examples whose bound is
        # above their estimate by more than 1e-4 (kappa above ~10^4) get their norm from
        # their own float64 matrix instead, one at a time.
        f._wide = precision.ill_conditioned(tf.sqrt(sq), norm - tf.sqrt(sq))
        exact.append((f, sq, norm, slack, l1))
    if _internals.compiling_with_xla():
        # Static shapes: the gathered loop's sizes depend on how many examples are wide,
        # which XLA cannot compile (a Dense over a sequence did not run under jit_compile).
        outs = precision.masked_exact_outer_norms([(f.a, f.g, l1, f._wide)
                                                   for f, _, _, _, l1 in exact])
        for (f, sq, norm, slack, _), (sq_w, norm_w) in zip(exact, outs):
            f._sq = tf.where(f._wide, sq_w, sq)
            f._bound = tf.where(f._wide, norm_w, norm) + slack
        return
    wides = [tf.where(f._wide) for f, *_ in exact]
    outs = precision.joint_exact_outer_norms([(f.a, f.g, l1, wide[:, 0])
                                              for (f, _, _, _, l1), wide in zip(exact, wides)])
    for (f, sq, norm, slack, _), wide, (sq_w, norm_w) in zip(exact, wides, outs):
        f._sq = tf.tensor_scatter_nd_update(sq, wide, sq_w)
        f._bound = tf.tensor_scatter_nd_update(norm, wide, norm_w) + slack


class EmbeddingFactors(Factors):
    """Rows ``ids[i, t]`` receive ``g[i, t]``: norms from row sums of equal ids, the clipped
    sum by one segment sum."""

    def __init__(self, variable, ids, g, options: FactorOptions):
        super().__init__(variable, options)
        self.ids, self.g = ids, g
        self.wide = None
        if options.exact_norms:
            self.sq, self.bound, self.wide = precision.embedding_norms(ids, g)

    def dependencies(self):
        return [self.ids, self.g]

    def sum_slack(self):
        return precision.embedding_sum_slack(self.ids, self.g)

    def project(self, directions):
        return self.project_rows(directions, self.ids)

    def unique_rows(self):
        """(the distinct ids (U,), each position's index among them (B, T)): directions are
        needed on those rows only (``project_rows``)."""
        rows, pos = tf.unique(tf.reshape(self.ids, [-1]))
        return rows, tf.reshape(pos, tf.shape(self.ids))

    def project_rows(self, directions, pos):
        """``P[j, i] = sum_t <directions[j, pos[i, t]], g[i, t]>`` for directions (r, U, width)
        given on rows ``pos`` indexes (the whole table for ``pos = ids``)."""
        r = directions.shape[0]
        v = tf.cast(directions, self.g.dtype)
        return tf.stack([tf.einsum("btd,btd->b", tf.gather(v[j], pos), self.g)
                         for j in range(r)])

    def whole_sum(self, w, sanitize=None):
        # At once: a chunk's sum is a dense table (rows x width) in float64.
        g = sanitized([self.g], w, sanitize)[0]
        f64 = precision.SUM_DTYPE
        rows_out, width = self.variable.shape[0], self.variable.shape[-1]
        # In float64: the float32 segment sum let an example whose tokens cancel absorb the
        # others' contributions to a row (5.1 C, session 14).
        return tf.math.unsorted_segment_sum(
            tf.reshape(tf.cast(g, f64) * tf.cast(w, f64)[:, None, None], [-1, width]),
            tf.reshape(self.ids, [-1]), rows_out)


def _entries(t):
    """Entries per example of ``t`` (B, ...), None when not static."""
    return t.shape[1:].num_elements() if t.shape.rank is not None else None


def _float64_bytes(*tensors):
    """Bytes per example of float64 copies of ``tensors`` (B, ...); None when a size is not
    static (a sequence length left unknown: the sums then run at once, not in chunks)."""
    entries = [_entries(t) for t in tensors]
    return None if None in entries else 8 * sum(entries)


#: The float64 temporaries of one chunk of examples of ``joint_weighted_sums`` take at most
#: this many bytes (at least one example per chunk): float64 copies of a whole batch's
#: per-example gradients halved the CNN's largest batch (0.82x -> 0.45x non-private).
_SUM_CHUNK_BYTES = 16 << 20


def sanitized(tensors, w, sanitize):
    """``tensors`` (per-example, rows first) with the examples of weight 0 zeroed when the
    scalar bool tensor ``sanitize`` holds (a ``tf.cond``: nothing is copied otherwise); as
    they are when ``sanitize`` is None. ``w``: the (B,) weights, or one per tensor."""
    tensors = list(tensors)
    if sanitize is None:
        return tensors
    ws = list(w) if isinstance(w, (list, tuple)) else [w] * len(tensors)
    out = tf.cond(sanitize,
                  lambda: tuple(precision.drop_examples(t, v) for t, v in zip(tensors, ws)),
                  lambda: tuple(tensors))
    return list(tf.nest.flatten(out))


def joint_weighted_sums(factors, weights, sanitize=None):
    """``sum_i w_i g_i`` of every factor with its (B,) ``weights``, in float64.

    ``sanitize``: None, or a scalar bool tensor; when it holds, the examples of weight 0 add
    nothing even where their factors are inf or NaN (0 * inf is NaN): each chunk's tensors
    are zeroed there first (``sanitized``). A ``tf.cond`` around the zeroing only, so the
    sums are traced once and ordinary steps copy nothing.

    Factors with ``sum_parts`` are summed over chunks of examples in ONE sequential loop for
    all of them (one loop body in the graph, as ``precision.joint_gram_norms``), each chunk's
    float64 sum added to a float64 total: the float64 copies exist for one weight and one
    chunk at a time. Each term still reaches the total through at most 2n + 2 roundings (n
    terms contracted; ``precision.contraction_slack``). Under XLA, or when the batch is
    known to fit one chunk, at once."""
    out = [None] * len(factors)
    looped = []
    for k, (f, w) in enumerate(zip(factors, weights)):
        parts = f.sum_parts()
        if parts is None:
            out[k] = f.whole_sum(w) if sanitize is None else f.whole_sum(w, sanitize=sanitize)
        else:
            looped.append((k, w, *parts, f.variable.shape))
    if not looped:
        return out
    sizes = [b for *_, b, _ in looped]
    batch = looped[0][2][0].shape[0]
    if _internals.compiling_with_xla():
        sums = _group_parts(looped, lambda t: t, lambda w: w, sanitize, [])
    elif not all(sizes):
        # A size unknown while tracing (a length declared None): the chunk from the
        # tensors' sizes in the graph, the same rule (every call takes the loop).
        sums = _chunked_sums(looped, _dynamic_chunk(looped), sanitize)
    else:
        chunk = max(1, _SUM_CHUNK_BYTES // max(sizes))
        if batch is not None and batch <= chunk:
            sums = _group_parts(looped, lambda t: t, lambda w: w, sanitize, [])
        else:
            sums = _chunked_sums(looped, chunk, sanitize)
    for (k, *_), total in zip(looped, sums):
        out[k] = total
    return out


def _group_parts(looped, rows, weight_rows, sanitize, last):
    """Every looped factor's float64 sum over the examples ``rows`` selects, one weight's
    float64 copies at a time (each waits for the previous part). With ``sanitize``, one
    ``tf.cond`` zeroes the weight-0 examples of a group of consecutive factors whose float32
    copies take at most twice the largest factor's bytes (``_sanitize_groups``): a cond per
    weight cost the Transformer's first step ~1 s of tracing."""
    parts = []
    for group in _sanitize_groups(looped, sanitize):
        entries = [looped[k] for k in group]
        tensors = [[rows(t) for t in e[2]] for e in entries]
        with tf.control_dependencies(last):
            flat = sanitized([t for ts in tensors for t in ts],
                             [weight_rows(e[1]) for e, ts in zip(entries, tensors)
                              for _ in ts], sanitize)
        for e, ts in zip(entries, tensors):
            mine, flat = flat[:len(ts)], flat[len(ts):]
            with tf.control_dependencies(last):
                part = e[3](weight_rows(e[1]), *mine)
            last = [part]
            parts.append(part)
    return parts


def _sanitize_groups(looped, sanitize):
    """Indices of ``looped`` in groups of consecutive factors sharing one sanitizing cond:
    each group's bytes per example at most twice the largest factor's (one factor per group
    without ``sanitize`` or known sizes)."""
    sizes = [b for *_, b, _ in looped]
    if sanitize is None or not all(sizes):
        return [[k] for k in range(len(looped))]
    return consecutive_groups(sizes, 2 * max(sizes))


def consecutive_groups(sizes, budget):
    """Indices of ``sizes`` in groups of consecutive entries whose sizes add up to at most
    ``budget`` (an entry above it, or of size None, in a group of its own)."""
    groups, total = [], None
    for k, size in enumerate(sizes):
        if size is not None and total is not None and total + size <= budget:
            groups[-1].append(k)
            total += size
        else:
            groups.append([k])
            total = size
    return groups


def _dynamic_chunk(looped):
    """``max(1, _SUM_CHUNK_BYTES // b)`` with ``b`` the largest float64 bytes per example of
    the looped factors' tensors, computed in the graph (an int32 scalar)."""
    largest = tf.constant(1, tf.int64)
    for entry in looped:
        per_example = tf.add_n([tf.reduce_prod(tf.shape(t, out_type=tf.int64)[1:])
                                for t in entry[2]])
        largest = tf.maximum(largest, 8 * per_example)
    return tf.cast(tf.maximum(tf.constant(_SUM_CHUNK_BYTES, tf.int64) // largest, 1), tf.int32)


def _chunked_sums(looped, chunk, sanitize=None):
    batch = tf.shape(looped[0][2][0])[0]
    count = (batch + chunk - 1) // chunk

    def body(i, totals):
        start = i * chunk
        stop = tf.minimum(start + chunk, batch)
        parts = _group_parts(looped, lambda t: t[start:stop], lambda w: w[start:stop],
                             sanitize, [])
        return i + 1, tuple(total + part for total, part in zip(totals, parts))

    init = tuple(tf.zeros(shape, precision.SUM_DTYPE) for *_, shape in looped)
    _, totals = tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), init),
                              parallel_iterations=1, maximum_iterations=count)
    return list(totals)


def factors_for(variable, terms, dz_of, options: FactorOptions):
    """The factors of ``variable`` from its recorded ``terms`` (``dz_of(term)`` gives a
    term's output gradient), or None when they cannot describe it (an embedding table also
    used by another layer): the variable is then left to the vectorized fallback."""
    kinds = {type(t) for t in terms}
    if kinds == {OuterTerm}:
        a, g = _concat_factors(terms, dz_of)
        return OuterFactors(variable, a, g, options)
    if kinds == {EmbeddingTerm}:
        ids, g = _concat_factors(terms, dz_of)
        return EmbeddingFactors(variable, ids, g, options)
    per, dzs = None, []
    first = _next_op_id()
    for t in terms:
        dz = dz_of(t)
        dzs.append(dz)
        p = t.per_example(dz)
        if p is None:
            return None
        p = precision.flat_per_example(p)
        per = p if per is None else per + p
    _formed_before_the_backward_goes_on(per, dzs, first)
    return MaterialisedFactors(variable, per, options)


def _next_op_id():
    """The id the next op of the current graph will get (None when executing eagerly)."""
    if tf.executing_eagerly():
        return None
    # Ops get increasing ids in creation order.
    return max(tf.compat.v1.get_default_graph()._nodes_by_id.keys(), default=0) + 1  # noqa: SLF001


def _formed_before_the_backward_goes_on(per, dzs, first):
    """Makes the ops that read the output gradients ``dzs`` before ``per`` was formed from
    them (the backward pass's, made by the tape) wait for ``per``; ``first``: the id of
    ``per``'s first op.

    A per-example gradient smaller than what it is made of (a LayerNormalization scale's
    (B, d) from its (B, T, d) output gradient and normalised input) frees them once it
    exists. It is ready as soon as its output gradient is, but the executor may leave it
    until the end of the backward pass (with one inter-op thread, ready ops beyond the one
    it goes on with are queued last in, first out): the 11.4M Transformer's JL step held two
    (B, T, 256) tensors per normalisation through the backward pass (+50 MiB at batch 64,
    docs/scaling.md §7). Skipped when a control edge could close a cycle: ``per``'s own ops
    may read, besides the output gradients, only tensors older than them (an op's inputs
    are older than it, so nothing downstream of an output gradient).
    """
    if first is None or not hasattr(per, "op"):
        return
    sources, chain = [], set()
    for dz in dzs:
        t = dz
        while True:  # back through the casts and identities dz_of may have added
            sources.append(t)
            op = t.op
            if op._id < first or op.control_inputs or op.type not in ("Cast", "Identity"):  # noqa: SLF001
                break
            chain.add(op)
            t = op.inputs[0]
    oldest = min(t.op._id for t in sources)  # noqa: SLF001
    source_ids = {id(t) for t in sources}
    stack, seen = [per.op], set()
    while stack:  # per's own ops (ids >= first): what do they read?
        op = stack.pop()
        if op in seen or op in chain:
            continue
        seen.add(op)
        reads = [x.op for x in op.inputs if id(x) not in source_ids] + list(op.control_inputs)
        for r in reads:
            if r._id >= first:  # noqa: SLF001
                stack.append(r)
            elif r._id >= oldest:  # noqa: SLF001
                return  # possibly downstream of an output gradient
    # A reader that is itself upstream of one of the output gradients (a layer applied to
    # its own output: the gradient at its first call's output is formed by the backward
    # pass through its second call, which reads the second call's output gradient) would
    # wait for ``per``, which needs that gradient: a cycle ("nodes in a cycle", seen in the
    # session 13 audit). Those readers keep their order.
    upstream, stack = set(), [t.op for t in sources]
    while stack:
        op = stack.pop()
        if op in upstream or (op._id < oldest and not op.control_inputs):  # noqa: SLF001
            continue
        upstream.add(op)
        stack.extend(x.op for x in op.inputs)
        stack.extend(op.control_inputs)
    for t in sources:
        for reader in t.consumers():
            if reader._id < first and reader not in chain and reader not in upstream:  # noqa: SLF001
                reader._add_control_input(per.op)  # noqa: SLF001


#: materialised per-example gradients of at most this many entries have their norms formed
#: together (concatenated) by ``combined_norms``.
_SMALL_NORMS_MAX_ENTRIES = 4096


def _joins_small_norms(f) -> bool:
    if type(f) is not MaterialisedFactors or f._norms is not None or not f.options.exact_norms:
        return False
    n = f.per.shape[1:].num_elements() if f.per.shape.rank is not None else None
    return n is not None and 0 < n <= _SMALL_NORMS_MAX_ENTRIES and f.per.dtype.is_floating


def combined_norms(factors, like):
    """Per-example norms and their bounds over several weights' ``factors``.

    ``like``: a (B,) tensor (zeros come out when there is no weight).
    Returns (norms, bounds), (B,) float64: ``bounds[i]`` bounds the norm of everything the
    weighted sums add for example i per unit weight (``sqrt(sum_v bound_v^2)``, the norm of a
    concatenation of parts each bounded by ``bound_v``).
    """
    if not factors:
        zeros = tf.zeros_like(tf.cast(like, tf.float64))
        return zeros, zeros
    form_gram_norms(factors)
    small = [f for f in factors if _joins_small_norms(f)]
    if len(small) < 2:
        small = []
    rest = [f for f in factors if not any(f is g for g in small)]
    sq_parts = [f.sq for f in rest]
    bound_sq_parts = [tf.square(f.bound) for f in rest]
    if small:
        # Small per-example gradients (biases, normalisation scales) get their squares from
        # one concatenation, in float64 (exact to ~1e-16; they are small): the bound of the
        # concatenated part, with a fraction of the graph ops of a bound per weight.
        sq, upper = precision.squared_norms(tf.concat(
            [tf.cast(precision.flat_per_example(f.per), tf.float64) for f in small], axis=1))
        sq_parts.append(sq)
        bound_sq_parts.append(upper)
    sq = tf.add_n(sq_parts)
    bound_sq = tf.add_n(bound_sq_parts)
    # sqrt(sum of V squares) in float64: relative error far below float32's. The float64
    # weighted sums of gradients formed outright (or of one product per entry) carry an
    # example's own terms through at most B + 2 roundings (precision.contraction_slack);
    # the factors whose terms may cancel have theirs in their bounds (sum_slack).
    return tf.sqrt(sq), (tf.sqrt(bound_sq) * (1.0 + gamma(len(factors) + 4, tf.float64))
                         * precision.outright_sum_factor(like))
