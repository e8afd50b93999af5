"""The one private-step pipeline shared by every tf_dp optimizer (see DESIGN.md).

    per-example norms  ->  clip factors w_i = min(1, C / ||g_i||)  ->  sum_i w_i g_i
    -> + N(0, sigma^2 C^2) once per logical step  ->  / expected batch size

Only the norm strategy differs between optimizers; these functions are composed by
``tf_dp.keras.DPModel.train_step`` and the DP optimizers.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tf_dp.core import ghost, jl, vmap

NORM_STRATEGIES = ("auto", "ghost", "vmap", "jl")


@dataclasses.dataclass
class ClippedSum:
    """Result of the clipping stage for one (micro-)batch."""

    grads: list  # sum_i w_i g_i for each privatized variable, in the variable's shape
    losses: tf.Tensor  # per-example losses (B,)
    y_pred: object  # model outputs, for metrics
    norms: tf.Tensor  # per-example gradient norms (B,) before clipping


def clip_factors(norms, l2_norm_clip, dtype=tf.float32, non_finite: str = "error"):
    """``w_i = C / max(n_i, C)``, i.e. ``min(1, C/n_i)`` and 1 for a zero gradient.

    ``norms`` must bound the norm of what the weighted sums add for each example per unit
    weight, the rounding of those sums included (``ghost.combined_norms`` gives such bounds)
    except that of their final products by ``w_i``. The factors are formed in float64 and
    returned in ``dtype``, the dtype in which the sums multiply by them (float32; float64 for
    float64 models), never in a lower-precision compute dtype (bfloat16 would round a factor
    up by up to 2^-9). So every example's contribution to the tensors actually summed is at
    most ``C (1 + 3u)`` (``w_i``'s rounding and two final products; u = 2^-24 in float32).

    ``non_finite``: "error" (non-finite norms stop training with a clear error instead of
    reaching the weights) or "zero" (such an example gets factor 0 and contributes nothing:
    a function of that example alone, so every example's contribution stays within C).
    """
    if non_finite not in ("error", "zero"):
        raise ValueError(f"`non_finite` must be 'error' or 'zero', got {non_finite!r}.")
    norms = tf.cast(norms, tf.float64)
    if non_finite == "error":
        norms = tf.debugging.assert_all_finite(
            norms, "tf_dp: a per-example gradient is NaN or infinite (check the loss, inputs "
                   "and learning rate); the step was not applied.")
    if isinstance(l2_norm_clip, (int, float)) and l2_norm_clip == float("inf"):
        w64 = tf.ones_like(norms)  # no clipping (a non-private reference)
    else:
        c = tf.cast(l2_norm_clip, tf.float64)
        w64 = c / tf.maximum(norms, c)
    if non_finite == "zero":
        w64 = tf.where(tf.math.is_finite(norms), w64, tf.zeros_like(w64))
    return tf.stop_gradient(tf.cast(w64, dtype))


def _non_finite_policy(model):
    """How ``clip_factors`` treats non-finite per-example gradients of ``model``.

    "zero" when a layer computes in float16, whose range (65504) makes a per-example overflow
    of the backward pass an expected numeric event that must not stop (or, as dynamic loss
    scaling would, skip) the step depending on the data; "error" otherwise.
    """
    return "zero" if ghost.computes_in_float16(model) else "error"


def batch_size_of(x):
    leaf = next(t for t in tf.nest.flatten(x) if t is not None)
    static = leaf.shape[0]
    return static if static is not None else tf.shape(leaf)[0]


def _check_no_cross_example_layers(model):
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"Layer {layer.name!r} is a BatchNormalization layer: its batch statistics mix "
                "examples, so per-example gradients (and differential privacy) are undefined. "
                "Use keras.layers.GroupNormalization or LayerNormalization, or freeze it "
                "(layer.trainable = False).")


def clipped_sum(model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                variables=None, norm_strategy: str = "auto", num_projections: int = None,
                seed=None) -> ClippedSum:
    """Clips every example's gradient to ``l2_norm_clip`` and sums them.

    Args:
      model: the Keras model.
      x, y, sample_weight: one batch; padded examples carry sample weight 0.
      per_example_loss: ``fn(y_true, y_pred, sample_weight) -> (B,)``.
      l2_norm_clip: the clipping norm C.
      variables: variables to privatize (default: ``model.trainable_variables``).
      norm_strategy: "auto" (ghost formulas where registered, vectorized fallback for the
        rest), "ghost" (error if any variable lacks a formula), "vmap" (vectorized for all)
        or "jl" (norms estimated by ``num_projections`` JL projections; Bu et al. 2021).
      num_projections: r, for norm_strategy="jl".
      seed: (2,) int seed of the JL directions (norm_strategy="jl").
    """
    if norm_strategy not in NORM_STRATEGIES:
        raise ValueError(f"`norm_strategy` must be one of {NORM_STRATEGIES}, got "
                         f"{norm_strategy!r}.")
    _check_no_cross_example_layers(model)
    variables = list(model.trainable_variables if variables is None else variables)
    if norm_strategy == "jl":
        return _clipped_sum_jl(model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                               variables, num_projections, seed)
    if norm_strategy == "vmap":
        return _clipped_sum_vmap(model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                                 variables)

    non_finite = _non_finite_policy(model)
    by_id, losses, y_pred = _ghost_pass(model, x, y, sample_weight, per_example_loss,
                                        variables, drop_non_finite=non_finite == "zero")
    fallback = [v for v in variables if id(v) not in by_id]
    if fallback and norm_strategy == "ghost":
        names = sorted({v.path.rsplit("/", 1)[0] for v in fallback})
        raise ValueError(
            f"norm_strategy='ghost' but these layers have no ghost-norm formula: {names}. "
            "Use norm_strategy='auto' (vectorized fallback for them).")
    fb_grads = []
    if fallback:
        fb_grads, _, _ = vmap.per_example_gradients(model, per_example_loss, x, y,
                                                    sample_weight, fallback)
    # Norms and clip factors in float64/float32 from bounds of what the sums below add.
    norms, bounds = ghost.combined_norms(list(by_id.values()), fb_grads, losses)
    w = clip_factors(bounds, l2_norm_clip, ghost.accumulation_dtype(losses.dtype), non_finite)
    fb_by_id = {id(v): g for v, g in zip(fallback, fb_grads)}
    grads = []
    for v in variables:
        if id(v) in by_id:
            grads.append(tf.cast(by_id[id(v)].weighted_sum(w), v.dtype))
        else:
            g = ghost.weighted_per_example_sum(w, fb_by_id[id(v)], non_finite == "zero")
            grads.append(tf.cast(g, v.dtype))
    return ClippedSum(grads=grads, losses=losses, y_pred=y_pred,
                      norms=tf.cast(norms, losses.dtype))


def _handles(variables):
    return [v.value if hasattr(v, "value") else v for v in variables]


def _ghost_pass(model, x, y, sample_weight, per_example_loss, variables, **norm_options):
    """One captured forward pass and one backward pass to the recorded layer outputs.

    Returns ({id(variable): its factors} for the ``variables`` a ghost rule covers, the
    per-example losses, the outputs). ``norm_options`` go to ``ghost.ghost_norms``.
    """
    with tf.GradientTape() as tape:
        # Privatized variables may be non-trainable (RGP carriers): watch them explicitly.
        tape.watch(_handles(variables))
        with ghost.capture(ghost.capturable_layers(model), batch_size_of(x)) as rec:
            y_pred = model(x, training=True)
        losses = per_example_loss(y, y_pred, sample_weight)
        total = tf.reduce_sum(losses)
    norm_objs, _ = ghost.ghost_norms(rec, tape, total, **norm_options)
    wanted = {id(v) for v in variables}
    by_id = {id(o.variable): o for o in norm_objs.values() if id(o.variable) in wanted}
    return by_id, losses, y_pred


def _clipped_sum_vmap(model, x, y, sample_weight, per_example_loss, l2_norm_clip, variables):
    per_ex, losses, y_pred = vmap.per_example_gradients(model, per_example_loss, x, y,
                                                        sample_weight, variables)
    non_finite = _non_finite_policy(model)
    norms, bounds = ghost.combined_norms([], per_ex, losses)
    w = clip_factors(bounds, l2_norm_clip, ghost.accumulation_dtype(losses.dtype), non_finite)
    grads = [tf.cast(ghost.weighted_per_example_sum(w, g, non_finite == "zero"), v.dtype)
             for g, v in zip(per_ex, variables)]
    return ClippedSum(grads=grads, losses=losses, y_pred=y_pred,
                      norms=tf.cast(norms, losses.dtype))


def _clipped_sum_jl(model, x, y, sample_weight, per_example_loss, l2_norm_clip, variables,
                    num_projections, seed):
    """JL norms (Bu et al. 2021): ``M_i = sqrt(mean_j <g_i, v_j>^2)``, then the clipped sum.

    ``<g_i, v_j>`` is summed over variables: from the recorded factors for every variable
    a ghost rule covers (one forward, one backward to the layer outputs), by forward-mode
    JVPs for the others. The clipped sum is formed from the same factors for the former
    and by one backward pass of ``sum_i w_i l_i`` for the latter.
    """
    jl.validate_num_projections(num_projections)
    if seed is None:
        raise ValueError("norm_strategy='jl' needs a `seed` for its projections.")
    replay = jl.save_random_state(model)
    non_finite = _non_finite_policy(model)
    by_id, losses, y_pred = _ghost_pass(model, x, y, sample_weight, per_example_loss,
                                        variables, exact_norms=False,
                                        num_projections=num_projections,
                                        drop_non_finite=non_finite == "zero")
    dirs = jl.directions(variables, num_projections, seed)
    projections = tf.zeros([num_projections, tf.shape(losses)[0]], tf.float64)
    for k, v in enumerate(variables):
        if id(v) in by_id:
            stacked = tf.stack([dirs[j][k] for j in range(num_projections)])
            projections += tf.cast(by_id[id(v)].project(stacked), tf.float64)
    fallback = [k for k, v in enumerate(variables) if id(v) not in by_id]
    fb_tape = None
    if fallback:
        fb_vars = [variables[k] for k in fallback]
        fb_tape = tf.GradientTape(watch_accessed_variables=False)
        with fb_tape:
            fb_tape.watch(_handles(fb_vars))
        fb_losses, _, fb_proj = jl.forward_projections(
            model, per_example_loss, x, y, sample_weight, fb_vars,
            [[dirs[j][k] for k in fallback] for j in range(num_projections)], fb_tape, replay)
        projections += tf.cast(fb_proj, tf.float64)
    norms = jl.jl_norms(projections)
    w = clip_factors(norms, l2_norm_clip, ghost.accumulation_dtype(losses.dtype), non_finite)
    fb_grads = {}
    if fallback:
        with fb_tape:
            # One backward pass of sum_i l_i / max(1, M_i / C) gives their clipped sum.
            weighted = tf.reduce_sum(tf.cast(w, fb_losses.dtype) * fb_losses)
        got = fb_tape.gradient(weighted, _handles(fb_vars),
                               unconnected_gradients=tf.UnconnectedGradients.ZERO)
        fb_grads = {id(v): g for v, g in zip(fb_vars, got)}
    grads = []
    for v in variables:
        g = by_id[id(v)].weighted_sum(w) if id(v) in by_id else fb_grads[id(v)]
        grads.append(tf.cast(tf.convert_to_tensor(g), v.dtype))
    return ClippedSum(grads=grads, losses=losses, y_pred=y_pred,
                      norms=tf.cast(norms, losses.dtype))


def gaussian_noise(shapes_dtypes, stddev, seed):
    """Independent N(0, stddev^2) noise for each (shape, dtype), from a stateless seed.

    ``seed`` is a (2,) int tensor; each tensor gets its own derived seed so that noise is
    reproducible given the seed and independent across variables.
    """
    out = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        s = tf.random.experimental.stateless_fold_in(seed, i)
        out.append(tf.cast(tf.random.stateless_normal(shape, seed=s, stddev=1.0,
                                                      dtype=tf.float32) * stddev, dtype))
    return out
