"""How the clip norm is chosen: flat (one C), per layer (C split over groups) or adaptive
(C follows a quantile of the per-example norms, Andrew et al. 2021).

Per-layer clipping (McMahan et al. 2018, §"per-layer clipping"): the privatized variables
are split into groups (one per layer by default); example i's gradient on group k is clipped
to ``C_k = C sqrt(s_k)`` with shares ``s_k`` summing to 1, so its whole contribution has norm
at most ``sqrt(sum_k C_k^2) = C``. The noise N(0, sigma^2 C^2) on every coordinate is then
the same Gaussian mechanism as flat clipping at C: the accountant needs no change.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning
with Adaptive Clipping", NeurIPS 2021, Algorithm 1 with the geometric update): each logical
step also releases the noised fraction of examples whose norm is at most C,

    b = (sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)) / E + 1/2     (E = q N)
    C <- C exp(-eta (b - gamma))

Each example changes the count by 1/2, so the step is one Gaussian mechanism on the vector
(clipped sum, count) whose noise multiplier is ``z = (sigma_g^-2 + (2 sigma_b)^-2)^-1/2``.
tf_dp keeps the optimizer's ``noise_multiplier`` as that joint z (what the accountant
composes, so epsilon is unchanged) and gives the gradient the slightly larger
``sigma_g = (z^-2 - (2 sigma_b)^-2)^-1/2``. C is post-processing of released values, so
it may be saved and restored; the noise is not.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """C follows the ``target_quantile`` of the per-example gradient norms.

    Args:
      target_quantile: gamma in (0, 1), the fraction of examples meant to be unclipped
        (0.5: the median norm, Andrew et al.'s recommendation).
      learning_rate: eta > 0 of the geometric update ``C <- C exp(-eta (b - gamma))``
        (0.2 in the paper).
      count_stddev: sigma_b, the std of the noise on the count of unclipped examples (in
        examples). None: ``E / 20`` for expected logical batch E, the paper's choice. Must
        satisfy ``2 sigma_b > noise_multiplier`` (the count's share of the privacy budget
        must be less than all of it).
      min_clip, max_clip: C is kept in [min_clip, max_clip] (public constants: the bound is
        post-processing).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: Optional[float] = None
    min_clip: float = 1e-6
    max_clip: float = 1e6

    def __post_init__(self):
        def number(value, name, low=0.0, high=math.inf, open_low=True):
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or math.isnan(value) or not (low < value if open_low else low <= value)
                    or not value < high):
                raise ValueError(f"`{name}` of AdaptiveClipping must be a number in "
                                 f"({low:g}, {high:g}), got {value!r}.")
            return float(value)

        object.__setattr__(self, "target_quantile",
                           number(self.target_quantile, "target_quantile", 0.0, 1.0))
        object.__setattr__(self, "learning_rate", number(self.learning_rate, "learning_rate"))
        if self.count_stddev is not None:
            object.__setattr__(self, "count_stddev",
                               number(self.count_stddev, "count_stddev"))
        object.__setattr__(self, "min_clip", number(self.min_clip, "min_clip"))
        object.__setattr__(self, "max_clip", number(self.max_clip, "max_clip"))
        if not self.min_clip < self.max_clip:
            raise ValueError(f"`min_clip` ({self.min_clip:g}) of AdaptiveClipping must be below "
                             f"`max_clip` ({self.max_clip:g}).")

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    def count_noise(self, expected_batch_size):
        """sigma_b for a logical batch of expected size E (a number or a scalar tensor)."""
        if self.count_stddev is not None:
            return self.count_stddev
        return expected_batch_size / 20.0

    def update(self, clip, noised_count, expected_batch_size):
        """The next C from this step's noised centred count ``sum_i (b_i - 1/2) + noise``."""
        clip = as_float64(clip)
        fraction = as_float64(noised_count) / as_float64(expected_batch_size) + 0.5
        new = clip * tf.exp(-self.learning_rate * (fraction - self.target_quantile))
        return tf.clip_by_value(new, self.min_clip, self.max_clip)


def as_float64(value):
    """A number or tensor as float64 (a Python number directly: ``tf.cast`` would round it
    to float32 first)."""
    if isinstance(value, numbers.Real):
        return tf.constant(float(value), tf.float64)
    return tf.cast(value, tf.float64)


def gradient_noise_multiplier(noise_multiplier: float, count_stddev):
    """sigma_g with ``sigma_g^-2 + (2 sigma_b)^-2 = z^-2``: the gradient's noise multiplier
    that keeps the joint mechanism (clipped sum, count) at ``noise_multiplier`` z.

    ``count_stddev`` may be a tensor (an expected batch size known only in the graph); the
    condition ``2 sigma_b > z`` is then asserted in the graph.
    """
    if noise_multiplier == 0:
        return 0.0
    z = float(noise_multiplier)
    if isinstance(count_stddev, numbers.Real):
        if not 2.0 * count_stddev > z:
            raise ValueError(
                f"Adaptive clipping: the count noise std sigma_b = {count_stddev:g} must exceed "
                f"noise_multiplier / 2 = {z / 2:g} (the count would otherwise need more than the "
                "whole privacy budget). Raise AdaptiveClipping(count_stddev=...) or the batch "
                "size (default sigma_b is the expected batch size / 20).")
        return (z**-2 - (2.0 * count_stddev) ** -2) ** -0.5
    sb = tf.cast(count_stddev, tf.float64)
    rest = z**-2 - (2.0 * sb) ** -2
    check = tf.debugging.assert_positive(
        rest, message="tf_dp adaptive clipping: the count noise std (expected batch / 20 by "
                      "default) must exceed noise_multiplier / 2; raise count_stddev.")
    with tf.control_dependencies([check]):
        return tf.math.rsqrt(rest)


def centred_count(norms, clip, sample_weight=None):
    """``sum_i (1[norms_i <= C] - 1/2)`` over the real examples of a batch (sample weight
    not 0: Poisson padding rows are not examples). Each example changes it by 1/2."""
    norms = tf.cast(norms, tf.float64)
    below = tf.cast(norms <= as_float64(clip), tf.float64) - 0.5
    if sample_weight is not None:
        sw = tf.reshape(tf.cast(sample_weight, tf.float64), [tf.shape(norms)[0], -1])
        real = tf.reduce_max(tf.abs(sw), axis=1) > 0
        below = tf.where(real, below, tf.zeros_like(below))
    return tf.reduce_sum(below)


# ------------------------------------------------------------------------ per-layer groups


def group_key(variable) -> str:
    """The layer a variable belongs to (its path without the last component)."""
    path = getattr(variable, "path", None) or variable.name
    return path.rsplit("/", 1)[0] if "/" in path else path


@dataclasses.dataclass(frozen=True)
class ClipSpec:
    """What ``NormStrategy.clipped_sum`` clips to: a total C and, for per-layer clipping,
    groups of variable indices with their shares of C^2 (summing to 1)."""

    clip: object
    groups: tuple = ()
    shares: tuple = ()

    def scaled(self, factor: float) -> "ClipSpec":
        return dataclasses.replace(self, clip=self.clip * factor)

    def __mul__(self, factor):  # a loss scale multiplies C (tf_dp.core.loss_scale)
        return self.scaled(factor)

    def group_clips(self):
        """C_k = C sqrt(s_k) per group."""
        return [self.clip * math.sqrt(s) for s in self.shares]


def per_layer_spec(split, variables, clip) -> ClipSpec:
    """The ``ClipSpec`` of ``per_layer_clipping=split`` for ``variables``.

    ``split``: "equal" (every group the same share), "dimension" (shares proportional to
    the group's number of weights) or a dict {layer name: positive weight} naming every
    group (shares are the weights normalised to sum 1); a name matches the layer whose
    variable path ends with it (so "dense" for "model/dense"), and must match exactly one.
    """
    keys = []
    groups = {}
    for i, v in enumerate(variables):
        key = group_key(v)
        if key not in groups:
            keys.append(key)
            groups[key] = []
        groups[key].append(i)
    if split == "equal":
        weights = [1.0] * len(keys)
    elif split == "dimension":
        weights = [float(sum(int(math.prod(variables[i].shape)) for i in groups[k]))
                   for k in keys]
    elif isinstance(split, dict):
        # A name matches a group whose path is it or ends with "/" + it (a layer's name,
        # whatever models or scopes hold the layer); it must match exactly one group.
        matches = {name: [k for k in keys if k == name or k.endswith("/" + name)]
                   for name in split}
        ambiguous = {name: m for name, m in matches.items() if len(m) > 1}
        if ambiguous:
            raise ValueError(f"`per_layer_clipping` names match several layers: {ambiguous}; "
                             "use a longer part of their paths.")
        owner = {m[0]: name for name, m in matches.items() if m}
        unknown = sorted(name for name, m in matches.items() if not m)
        missing = [k for k in keys if k not in owner]
        if unknown or missing:
            raise ValueError(f"`per_layer_clipping` must name every privatized layer: missing "
                             f"{missing}, unknown {unknown} (layers: {keys}).")
        weights = []
        for k in keys:
            w = split[owner[k]]
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not w > 0 \
                    or math.isinf(w):
                raise ValueError(f"`per_layer_clipping` weight of {owner[k]!r} must be a "
                                 f"finite number > 0, got {w!r}.")
            weights.append(float(w))
    else:
        raise ValueError("`per_layer_clipping` must be None, 'equal', 'dimension' or a dict "
                         f"{{layer name: weight}}, got {split!r}.")
    total = sum(weights)
    return ClipSpec(clip=clip, groups=tuple(tuple(groups[k]) for k in keys),
                    shares=tuple(w / total for w in weights))


def validate_per_layer(split):
    """``split`` if it is a valid ``per_layer_clipping`` value (checked again, against the
    layers, at the first step)."""
    if split is None or split in ("equal", "dimension"):
        return split
    if isinstance(split, dict) and split and all(isinstance(k, str) for k in split):
        return dict(split)
    raise ValueError("`per_layer_clipping` must be None, 'equal', 'dimension' or a non-empty "
                     f"dict {{layer name: weight}}, got {split!r}.")
