"""How the private step gets every example's gradient norm: the ``NormStrategy`` seam.

    Auto()        ghost rules where a layer has one, exact vectorized gradients elsewhere
    Ghost()       ghost rules only (an error names the layers without one)
    Vectorized()  exact vectorized per-example gradients for every weight
    JL(r)         norms estimated by r JL projections (Bu et al. 2021, Algorithm 1)

Each strategy turns one batch into per-weight ``Factors`` (``tf_dp.core.ghost.factors``)
and per-example norm bounds; the clip factors and the clipped sums are then formed the
same way for all (``NormStrategy.clipped_sum``). A new strategy is a subclass that
implements ``_factors_and_norms``.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_dp import _internals, _validation
from tf_dp.accounting import mechanisms
from tf_dp.core import clipping, ghost, jl, vmap
from tf_dp.core.ghost import FactorOptions, MaterialisedFactors
from tf_dp.core.ghost import precision
from tf_dp.core.ghost.factors import EmbeddingFactors


@dataclasses.dataclass
class ClippedSum:
    """Result of the clipping stage for one (micro-)batch."""

    grads: list  # sum_i w_i g_i for each privatized variable, in the variable's shape, in
    # float64 whatever the variable's dtype (ghost.SUM_DTYPE): apply_private rounds once,
    # after the noise
    losses: tf.Tensor  # per-example losses (B,)
    y_pred: object  # model outputs, for metrics
    norms: tf.Tensor  # per-example gradient norms (B,) before clipping


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One batch and what the pipeline needs to run the model on it."""

    model: object
    x: object
    y: object
    sample_weight: object
    per_example_loss: object
    variables: list
    non_finite: str  # "error" or "zero", see ``clip_factors``
    real: object = None  # (B,) bool: rows of non-zero sample weight; None without weights


class NormStrategy:
    """Base class: subclasses give per-weight factors and per-example norm bounds."""

    #: the name used in configs and by ``get``.
    name: str = ""
    #: r for JL strategies (the accountant composes the JL mechanism), None for exact norms.
    num_projections = None

    def clipped_sum(self, model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                    variables=None, seed=None) -> ClippedSum:
        """``tf_dp.core.clipped_sum`` with this strategy: every example's gradient of
        ``variables`` clipped to ``l2_norm_clip`` and summed, behind its checks (the batch
        and declared dimensions hidden, one kind of trace, the precision and auto-clustering
        checks, layers that mix examples, padding to 16 rows; non-finite examples add
        nothing). This method skipped all of them, and stopped on a non-finite example,
        whose stop tells it was sampled (session 24 audit: the same rows summed to 2.74 C
        and to 0 in two traces)."""
        from tf_dp.core import private_step  # noqa: PLC0415 (private_step imports this)

        return private_step.clipped_sum(model, x, y, sample_weight, per_example_loss,
                                        l2_norm_clip, variables=variables, norm_strategy=self,
                                        seed=seed)

    def _clipped_sum(self, model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                     variables, seed=None, non_finite="zero") -> ClippedSum:
        """Clips every example's gradient of ``variables`` to ``l2_norm_clip`` and sums (no
        checks: ``private_step.clipped_sum`` runs them, then this).

        ``l2_norm_clip``: C (a number or a scalar tensor), or a ``tf_dp.core.clipping.ClipSpec``
        (per-layer clipping: each group's part clipped to its own C_k).
        """
        batch = _Batch(model, x, y, sample_weight, per_example_loss, list(variables),
                       non_finite, real_rows(sample_weight))
        spec = l2_norm_clip if isinstance(l2_norm_clip, clipping.ClipSpec) else None
        if spec is not None and spec.groups and self.num_projections is not None:
            raise ValueError("Per-layer clipping needs exact per-example norms of every group; "
                             f"`norm_strategy` {self!r} estimates only the total norm. Use "
                             "exact norms or flat clipping.")
        factors, bounds, norms, losses, y_pred = self._factors_and_norms(batch, seed)
        dtype = ghost.SUM_DTYPE  # the weighted sums apply the factors in float64
        if spec is None or not spec.groups:
            w = clip_factors(bounds, l2_norm_clip if spec is None else spec.clip, dtype,
                             non_finite, batch.real)
            weights = [w] * len(factors)
        else:
            # Per-layer clipping: group k's part of every example is clipped to C_k, so the
            # whole contribution is within sqrt(sum_k C_k^2) = C.
            weights = [None] * len(factors)
            for group, c_k in zip(spec.groups, spec.group_clips()):
                _, group_bounds = ghost.combined_norms([factors[i] for i in group], losses)
                w_k = clip_factors(group_bounds, c_k, dtype, non_finite, batch.real)
                for i in group:
                    weights[i] = w_k
        # In float64 (ghost.SUM_DTYPE), whatever the variables' dtype: they are rounded to it
        # once, after the noise (DPOptimizerMixin.apply_private).
        grads = [tf.cast(tf.convert_to_tensor(g), ghost.SUM_DTYPE)
                 for g in _weighted_sums(batch, factors, weights, bounds)]
        return ClippedSum(grads=grads, losses=losses, y_pred=y_pred,
                          norms=tf.cast(norms, losses.dtype))

    def _factors_and_norms(self, batch: _Batch, seed):
        """(factors per variable, clip bounds (B,), norms (B,), losses (B,), outputs)."""
        raise NotImplementedError

    def get_config(self) -> dict:
        return {"norm_strategy": self.name, "num_projections": self.num_projections}

    def __repr__(self):
        return f"tf_dp.{type(self).__name__}()"

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self), self.num_projections))


def _weighted_sums(batch: _Batch, factors, weights, bounds):
    """``ghost.joint_weighted_sums``, with the examples of clip factor 0 adding nothing even
    where their factors are inf or NaN: rows of sample weight 0 (a padding row of zeros that
    the model maps to NaN) and, under the "zero" policy, examples whose gradient is not
    finite.

    Their clip factor is 0 (``clip_factors``), so finite factors add exact zeros. A
    non-finite factor entry makes the example's clip bound non-finite (every bound is formed
    from every entry: sums of squares, Gram matrices, l1 products, JL projections;
    ``padding_rows_test`` pins it for each kind of factors), so the factors are zeroed (a
    ``tf.where``, 7-20 % of a step when it was always on) only when some bound is not finite.
    The flag is data dependent, as the step's time is: timing is outside the threat model
    (docs/privacy.md)."""
    if batch.real is None and batch.non_finite == "error":
        # Every example is real and a non-finite one stops the step (clip_factors).
        return ghost.joint_weighted_sums(factors, weights)
    sanitize = tf.logical_not(tf.reduce_all(tf.math.is_finite(tf.cast(bounds, tf.float64))))
    return ghost.joint_weighted_sums(factors, weights, sanitize=sanitize)


def _ghost_pass(batch: _Batch, options: FactorOptions):
    """One captured forward pass and one backward pass to the recorded layer outputs.

    Returns ({id(variable): Factors} for the variables a ghost rule covers, the per-example
    losses, the outputs).
    """
    with tf.GradientTape() as tape:
        # Privatized variables may be non-trainable (RGP carriers): watch them explicitly.
        tape.watch([_handle(v) for v in batch.variables])
        with ghost.capture(ghost.capturable_layers(batch.model), batch_size_of(batch.x),
                           tape) as ctx:
            y_pred = batch.model(batch.x, training=True)
        losses = batch.per_example_loss(batch.y, y_pred, batch.sample_weight)
        total = tf.reduce_sum(losses)
    factors = ghost.backward(ctx, tape, total, options)
    wanted = {id(v) for v in batch.variables}
    return {k: f for k, f in factors.items() if k in wanted}, losses, y_pred


def _handle(variable):
    return variable.value if hasattr(variable, "value") else variable


def _vectorized_factors(batch: _Batch, variables, options: FactorOptions):
    per_ex, losses, y_pred = vmap.per_example_gradients(
        batch.model, batch.per_example_loss, batch.x, batch.y, batch.sample_weight, variables,
        rows=True)
    # Row gradients (embeddings) keep their lookup form: the ghost rule's norms and sums.
    return {id(v): EmbeddingFactors(v, g.ids, g.values, options)
            if isinstance(g, vmap.RowGradients) else MaterialisedFactors(v, g, options)
            for v, g in zip(variables, per_ex)}, losses, y_pred


class _ExactStrategy(NormStrategy):
    """Exact norms: ``sqrt(sum over weights of squared norms)`` with rounding bounds."""

    def _covered(self, batch, options):
        """({id(variable): Factors} of what this strategy covers itself, losses, outputs)."""
        raise NotImplementedError

    def _factors_and_norms(self, batch, seed):
        options = FactorOptions()
        by_id, losses, y_pred = self._covered(batch, options)
        rest = [v for v in batch.variables if id(v) not in by_id]
        if rest:
            self._check_fallback(rest)
            more, _, _ = _vectorized_factors(batch, rest, options)
            by_id = {**by_id, **more}
        factors = [by_id[id(v)] for v in batch.variables]
        norms, bounds = ghost.combined_norms(factors, losses)
        return factors, bounds, norms, losses, y_pred

    def _check_fallback(self, variables):
        pass


class Auto(_ExactStrategy):
    """Ghost norms where a layer has a rule, exact vectorized per-example gradients for the
    other weights (the default)."""

    name = "auto"

    def _covered(self, batch, options):
        return _ghost_pass(batch, options)


class Ghost(Auto):
    """Ghost norms only: an error names the layers without a rule (instead of falling back)."""

    name = "ghost"

    def _check_fallback(self, variables):
        names = sorted({v.path.rsplit("/", 1)[0] for v in variables})
        raise ValueError(
            f"`norm_strategy` is Ghost() but these layers have no ghost-norm rule: {names}. "
            "Use norm_strategy='auto' (exact vectorized gradients for them).")


class Vectorized(_ExactStrategy):
    """Exact per-example gradients of every weight by ``tf.vectorized_map`` (any model)."""

    name = "vectorized"

    def _covered(self, batch, options):
        return _vectorized_factors(batch, batch.variables, options)


class JL(NormStrategy):
    """Per-example norms estimated by ``num_projections`` JL projections (Bu et al. 2021):
    ``M_i = sqrt(mean_j <g_i, v_j>^2)`` with fresh secret Gaussian directions ``v_j`` every
    step, accounted as the JL mechanism (``tf_dp.accounting``).

    ``<g_i, v_j>`` comes from the recorded factors for every weight a ghost rule covers (one
    forward, one backward pass), from the per-example gradients of the vectorized fallback
    for the others; the clipped sum from the same factors or gradients (so the estimate
    describes the tensors summed; their rounding is bounded by ``jl_clip_bounds``).
    """

    name = "jl"

    def __init__(self, num_projections: int):
        self._r = _validation.num_projections(num_projections, allow_none=False)

    @property
    def num_projections(self):
        return self._r

    def __repr__(self):
        return f"tf_dp.JL({self._r})"

    def _factors_and_norms(self, batch, seed):
        if seed is None:
            raise ValueError("JL norms need a `seed` for their directions (the optimizer's "
                             "secret stream provides one per step).")
        r, variables = self._r, batch.variables
        options = FactorOptions(exact_norms=False, num_projections=r)
        by_id, losses, y_pred = _ghost_pass(batch, options)
        rest = [v for v in variables if id(v) not in by_id]
        if rest:
            # Weights without a ghost rule: their per-example gradients, materialised by the
            # vectorized fallback, are what is projected AND what is summed. (Forward-mode
            # JVP projections with a weighted backward pass for the sum, used until session
            # 14, projected one computation and summed another: a custom layer's
            # x * w over two cancelling time steps of +-1e10 had projections exactly 0, so
            # clip factor 1, while its terms in the batch's backward sums absorbed every
            # other example's gradient: one example erased 41 C.)
            more, _, _ = _vectorized_factors(batch, rest, options)
            by_id = {**by_id, **more}
        # Each weight's directions are drawn where it is projected, once its factors exist
        # and the previous weight's projections are formed (last layers first, as the
        # backward pass forms their factors): one weight's directions are alive at a time,
        # not r full copies of every weight from the start of the step. Same numbers as
        # jl.directions(variables, r, seed), except for tables with embedding factors,
        # drawn on the looked-up rows only (jl.draw_rows).
        with tf.name_scope("jl_seeds"):  # (2,) each: drawn from the seed alone, in few ops
            seeds = jl.step_seeds(r, seed, len(variables))
        parts, previous = {}, []
        for k in reversed(range(len(variables))):
            parts[k] = self._project(by_id[id(variables[k])], variables[k], k, seeds[k],
                                     previous)
            previous = [parts[k]]
        projections = tf.zeros([r, tf.shape(losses)[0]], tf.float64)
        for k in sorted(parts):  # summed in the variables' order
            projections += tf.cast(parts[k], tf.float64)
        norms = jl.jl_norms(projections)
        factors = [by_id[id(v)] for v in variables]
        return factors, jl_clip_bounds(norms, factors), norms, losses, y_pred

    def _project(self, factors, variable, index, seeds, after):
        """(r, B) projections of one weight's factors on its directions (``seeds``: its row
        of ``jl.step_seeds``), drawn (in a name scope ``jl_directions_<index>``) under a
        control dependency on the factors and on ``after``."""
        r = self._r
        # Only the rows the batch looks up, for a table with embedding factors; not under
        # XLA, whose random ops need a static shape (how many rows a batch looks up depends
        # on the data: the step failed to run), and only where the step is known to run as
        # one part on one replica (jl.one_part_step). Elsewhere the whole table's
        # directions are drawn; on the looked-up rows they have the same law (jl.draw_rows).
        rows_only = (isinstance(factors, EmbeddingFactors)
                     and not _internals.compiling_with_xla() and jl.rows_only_allowed())
        if rows_only:
            rows, pos = factors.unique_rows()
        with tf.name_scope(f"jl_directions_{index}"), \
                tf.control_dependencies(factors.dependencies() + list(after)):
            if rows_only:
                dirs = jl.draw_rows(variable, index, r, None, tf.size(rows), seeds=seeds)
            else:
                dirs = jl.draw(variable, index, r, None, seeds=seeds)
        if rows_only:
            return factors.project_rows(dirs, pos)
        return factors.project(dirs)


def jl_clip_bounds(norms, factors):
    """The JL clip bounds: ``max(M_i, E_i / tau)``, ``M_i`` the JL estimates, ``E_i`` the
    bound of how much the float64 weighted sums of ``factors`` can add for example i beyond
    its exact gradient (``Factors.sum_slack``, combined over weights as the norm of a
    concatenation), tau = ``mechanisms.JL_ROUNDING_SLACK``.

    The JL estimate is formed from projections of the exact gradient g_i; the weighted sum
    adds ``w_i (g_i + e_i)`` with ``||e_i|| <= E_i``. When an example's terms cancel (huge
    factors, a tiny gradient) e_i is all it adds and no projection sees it: a zero gradient
    made of +-1e10 terms added 5 C (session 14 audit). With ``w_i = min(1, C / max(M_i,
    E_i / tau))`` the contribution is at most ``C (||g_i|| / M_i + tau)``, the sensitivity
    the JL accountant composes (``sqrt(r / X) + tau``). For ordinary gradients E_i / tau is
    far below M_i and nothing changes."""
    # The float64 sums of gradients formed outright (or of one product per entry) carry an
    # example's own terms through at most 2B + 2 roundings: the estimate is raised by that
    # factor, so that w_i times what they add stays within C ||g_i|| / M_i.
    norms = norms * precision.outright_sum_factor(norms)
    pairs = [(f, f.sum_slack()) for f in factors if hasattr(f, "sum_slack")]
    pairs = [(f, s) for f, s in pairs if s is not None]
    if not pairs:
        return norms
    # sqrt of V squares in float64 and one division: a few float64 roundings, covered.
    e = tf.sqrt(tf.add_n([tf.square(s) for _, s in pairs])) * (
        1.0 + precision.gamma(len(pairs) + 4, tf.float64))
    return tf.maximum(norms, e / mechanisms.JL_ROUNDING_SLACK)


_BY_NAME = {"auto": Auto, "ghost": Ghost, "vectorized": Vectorized, "vmap": Vectorized}


def get(norm_strategy, num_projections=None) -> NormStrategy:
    """A ``NormStrategy`` from an instance or a name ("auto", "ghost", "vectorized" — also
    "vmap" —, or "jl" with ``num_projections``)."""
    if isinstance(norm_strategy, NormStrategy):
        if num_projections is not None and num_projections != norm_strategy.num_projections:
            raise ValueError(f"`num_projections`={num_projections!r} contradicts "
                             f"`norm_strategy`={norm_strategy!r}.")
        return norm_strategy
    if norm_strategy == "jl":
        if num_projections is None:
            raise ValueError("`norm_strategy`='jl' needs `num_projections` (or pass "
                             "tf_dp.JL(num_projections)).")
        return JL(num_projections)
    if norm_strategy in _BY_NAME:
        if num_projections is not None:
            raise ValueError(f"`num_projections` is only for JL norms, got it with "
                             f"`norm_strategy`={norm_strategy!r}.")
        return _BY_NAME[norm_strategy]()
    raise ValueError("`norm_strategy` must be 'auto', 'ghost', 'vectorized', 'jl' or a "
                     f"tf_dp.NormStrategy such as tf_dp.JL(5), got {norm_strategy!r}.")


# -------------------------------------------------------------------------- shared stages


def real_rows(sample_weight):
    """(B,) bool: the rows of non-zero sample weight (any entry, for per-timestep weights),
    or None without sample weights. Rows of weight 0 (Poisson padding) are not examples."""
    if sample_weight is None:
        return None
    sw = tf.convert_to_tensor(sample_weight)
    if sw.shape.rank is None or sw.shape.rank == 0:
        raise ValueError(f"`sample_weight` must have one row per example, got shape "
                         f"{sw.shape}.")
    nonzero = tf.not_equal(sw, tf.zeros([], sw.dtype))
    if sw.shape.rank > 1:
        nonzero = tf.reduce_any(nonzero, axis=list(range(1, sw.shape.rank)))
    return nonzero


def clip_factors(norms, l2_norm_clip, dtype=tf.float32, non_finite: str = "zero",
                 real=None):
    """``w_i = C / max(n_i, C)``, i.e. ``min(1, C/n_i)`` and 1 for a zero gradient.

    ``norms`` must bound the norm of what the weighted sums add for each example per unit
    weight, the rounding of those sums included (``ghost.combined_norms`` gives such bounds)
    (``precision.contraction_slack`` counts the final products by ``w_i`` too). The factors
    are formed in float64 and returned in ``dtype``, the dtype in which the sums multiply by
    them: float64 (``ghost.SUM_DTYPE``) for the private step's sums, never a lower-precision
    compute dtype (bfloat16 would round a factor up by up to 2^-9). So every example's
    contribution to the sums is at most ``C (1 + 2u)`` (``w_i``'s rounding; u = 2^-53).

    ``non_finite``: "zero" (default: such an example gets factor 0 and contributes
    nothing, a function of that example alone, so every example's contribution stays within
    C) or "error" (non-finite norms stop training, a stop that tells the example was
    sampled; "error" was the default of this public function until session 24's review).

    ``real``: optional (B,) bool, the rows that are examples (``real_rows``). The others
    (sample weight 0: Poisson padding) get factor 0 and are never an error: a padding row of
    zeros that a model maps to NaN (x / ||x||) used to stop every step that had padding.
    """
    if non_finite not in ("error", "zero"):
        raise ValueError(f"`non_finite` must be 'error' or 'zero', got {non_finite!r}.")
    norms = tf.cast(norms, tf.float64)
    if real is not None:
        real = tf.reshape(tf.cast(real, tf.bool), tf.shape(norms))
        norms = tf.where(real, norms, tf.zeros_like(norms))
    if non_finite == "error":
        norms = tf.debugging.assert_all_finite(
            norms, "tf_dp: a per-example gradient is NaN or infinite (check the loss, inputs "
                   "and learning rate); the step was not applied.")
    if isinstance(l2_norm_clip, (int, float)) and l2_norm_clip == float("inf"):
        w64 = tf.ones_like(norms)  # no clipping (a non-private reference)
    else:
        # A Python number straight to float64 (tf.cast would round it to float32 first).
        c = (tf.constant(float(l2_norm_clip), tf.float64)
             if isinstance(l2_norm_clip, (int, float)) else tf.cast(l2_norm_clip, tf.float64))
        w64 = c / tf.maximum(norms, c)
    if non_finite == "zero":
        w64 = tf.where(tf.math.is_finite(norms), w64, tf.zeros_like(w64))
    if real is not None:
        w64 = tf.where(real, w64, tf.zeros_like(w64))
    return tf.stop_gradient(tf.cast(w64, dtype))


def batch_size_of(x):
    leaf = next(t for t in tf.nest.flatten(x) if t is not None)
    static = leaf.shape[0]
    return static if static is not None else tf.shape(leaf)[0]
