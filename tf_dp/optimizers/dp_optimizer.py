"""What every tf_dp optimizer shares: the DP configuration, noise once per logical step,
normalisation by the expected batch size, and the refusal to run outside a private step."""

from __future__ import annotations

import math
import numbers
import warnings

import tensorflow as tf

from tf_dp.core import ledger as ledger_lib
from tf_dp.core import private_step, randomness
from tf_dp.core.jl import validate_num_projections  # noqa: F401 (re-exported)

_PLAIN_MODEL_MESSAGE = (
    "{name} is a differentially private optimizer but was called by a plain Keras train "
    "step, which would train WITHOUT privacy (no per-example clipping). Wrap the model with "
    "`tf_dp.keras.make_private(model)` (or build it as tf_dp.keras.DPSequential / DPModel) "
    "before compile().")


def validate_dp_args(l2_norm_clip, noise_multiplier, gradient_accumulation_steps,
                     norm_strategy, seed):
    """Raises ValueError/TypeError naming the argument for each bad DP argument.

    ``l2_norm_clip = inf`` means no clipping and is only accepted with
    ``noise_multiplier = 0`` (a non-private reference run); noise scaled by an infinite clip
    would be infinite.
    """
    if isinstance(l2_norm_clip, bool) or not isinstance(l2_norm_clip, numbers.Real):
        raise TypeError(f"`l2_norm_clip` must be a number, got {l2_norm_clip!r}.")
    if math.isnan(l2_norm_clip) or not l2_norm_clip > 0:
        raise ValueError(f"`l2_norm_clip` must be > 0, got {l2_norm_clip}.")
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, numbers.Real):
        raise TypeError(f"`noise_multiplier` must be a number, got {noise_multiplier!r}.")
    if not noise_multiplier >= 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"`noise_multiplier` must be finite and >= 0, got {noise_multiplier}.")
    if math.isinf(l2_norm_clip) and noise_multiplier > 0:
        raise ValueError("`l2_norm_clip` is inf (no clipping) but `noise_multiplier` is "
                         f"{noise_multiplier}: the noise std sigma*C would be infinite.")
    if gradient_accumulation_steps is not None and (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, numbers.Integral)
            or gradient_accumulation_steps < 1):
        raise ValueError("`gradient_accumulation_steps` must be an integer >= 1, got "
                         f"{gradient_accumulation_steps!r}.")
    exact = tuple(s for s in private_step.NORM_STRATEGIES if s != "jl")
    if norm_strategy not in exact:
        raise ValueError(f"`norm_strategy` must be one of {exact}, got {norm_strategy!r} "
                         "(for JL norms use DPSGDJL / DPAdamJL / DPAdamWJL).")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"`seed` must be an int or None, got {seed!r}.")


class DPOptimizerMixin:
    """Mixed into a Keras optimizer class (before it in the bases) to make it private.

    The private train step (``tf_dp.keras.DPModel``) clips per example and calls
    ``apply_private``; this class adds the Gaussian noise once per logical step, scales by
    the expected batch size, hands the result to the Keras update rule and records the step
    in its ledger (``tf_dp.core.ledger``), from which the model's accountant learns of every
    applied step, whatever loop ran it.

    Noise and JL directions come from secret streams (``tf_dp.core.randomness``): a 128-bit
    key from the OS and a counter that only increases, neither of which is saved anywhere, so
    no restore, re-compile or re-run reproduces noise already drawn. The DP parameters
    (``l2_norm_clip``, ``noise_multiplier``, ``num_projections``, ...) are read-only: the
    traced step and the accountant could otherwise disagree.
    """

    _dp_keys = ("l2_norm_clip", "noise_multiplier", "seed", "norm_strategy")

    def _init_dp(self, l2_norm_clip, noise_multiplier, seed, norm_strategy,
                 gradient_accumulation_steps):
        # Arguments were validated by `validate_dp_args` before the Keras base __init__.
        # Accumulation is done inside the private train step (one logical batch is split into
        # k micro-batches), never by Keras, so noise is added once per step on any number of
        # replicas and learning-rate schedules count logical steps.
        num_projections = getattr(self, "_dp_pending_num_projections", None)
        object.__setattr__(self, "_dp_params", {
            "l2_norm_clip": float(l2_norm_clip),
            "noise_multiplier": float(noise_multiplier),
            "norm_strategy": "jl" if num_projections is not None else norm_strategy,
            "num_projections": num_projections,
            "accumulation_steps": int(gradient_accumulation_steps or 1),
            "seed": None if seed is None else int(seed),
        })
        # Plain Python attributes holding tf.Variables: Keras and tf.train.Checkpoint track
        # neither, so no saved file holds the key, the counters or the ledger.
        object.__setattr__(self, "_dp_noise", randomness.SecretStream("noise", seed))
        object.__setattr__(self, "_dp_jl", randomness.SecretStream("jl", seed))
        object.__setattr__(self, "_dp_ledger", ledger_lib.StepLedger())
        object.__setattr__(self, "_dp_fit_calls", 0)
        self._inside_private_step = False
        if seed is not None:
            randomness.warn_seeded(type(self).__name__, seed)
        if noise_multiplier == 0:
            warnings.warn(f"tf_dp: {type(self).__name__} has `noise_multiplier=0`: its updates "
                          "are not private (epsilon is infinite). Use it only as a non-private "
                          "reference.", UserWarning, stacklevel=3)

    # -- read-only DP parameters ---------------------------------------------------------

    def _dp_param(name):  # noqa: N805 (a property factory used in the class body)
        def get(self):
            return self._dp_params[name]

        def refuse(self, value):
            raise AttributeError(
                f"`{name}` of a tf_dp optimizer cannot be changed after it is created (the "
                "traced private step and the privacy accountant would disagree); create a new "
                "optimizer and compile with it.")

        return property(get, refuse, doc=f"The optimizer's `{name}` (read-only).")

    l2_norm_clip = _dp_param("l2_norm_clip")
    noise_multiplier = _dp_param("noise_multiplier")
    norm_strategy = _dp_param("norm_strategy")
    #: r for the JL optimizers; None means exact per-example norms.
    num_projections = _dp_param("num_projections")
    accumulation_steps = _dp_param("accumulation_steps")
    seed = _dp_param("seed")
    del _dp_param

    @property
    def seeded(self) -> bool:
        """True if noise is derived from a user seed (the privacy guarantee does not hold)."""
        return self._dp_params["seed"] is not None

    # -- the private update ----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if not self._inside_private_step:
            raise RuntimeError(_PLAIN_MODEL_MESSAGE.format(name=type(self).__name__))
        return super().apply(grads, trainable_variables)

    def next_jl_seed(self):
        """A fresh secret (2,) seed for one logical step's JL directions."""
        return self._dp_jl.next_seed()

    def apply_private(self, clipped_sums, variables, expected_batch_size,
                      sampling_probability=None, noise_masks=None, to_trainable=None,
                      extra_gradients=None):
        """Adds the noise of one logical step, normalises, applies and records the step.

        Args:
          clipped_sums: ``sum_i w_i g_i`` per variable, over this replica's share of the
            logical batch (all its micro-batches).
          variables: the variables they belong to.
          expected_batch_size: the expected size of the *global* logical batch (q*N under
            Poisson sampling), never the realised one.
          sampling_probability: q of this step, as a Python number, recorded in the ledger
            for the accountant. None records q = 1 (no amplification by sampling: always a
            valid bound).
          noise_masks: optional per-variable 0/1 masks (None entries allowed): noise is
            multiplied by them (LSG's frozen entries get none).
          to_trainable: optional ``fn(grads, variables) -> (grads, variables)`` applied to the
            noised gradients (post-processing), e.g. RGP's carrier-to-weight reconstruction.
          extra_gradients: optional {id(variable): gradient} of data-independent terms
            (weight regularisers), added after privatisation.
        """
        q = 1.0 if sampling_probability is None else float(sampling_probability)
        if not 0 < q <= 1:
            raise ValueError(f"`sampling_probability` must be in (0, 1], got "
                             f"{sampling_probability!r}.")
        ctx = tf.distribute.get_replica_context()
        replica_id = ctx.replica_id_in_sync_group if ctx is not None else 0
        # Keras sums the replicas' gradients: only the first replica adds noise.
        first_replica = tf.cast(tf.equal(tf.cast(replica_id, tf.int32), 0), tf.float32)
        stddev = self.noise_multiplier * self.l2_norm_clip
        shapes = [(v.shape, g.dtype) for g, v in zip(clipped_sums, variables)]
        if stddev > 0:
            noise = private_step.gaussian_noise(shapes, stddev, self._dp_noise.next_seed())
            noise = [n * tf.cast(first_replica, n.dtype) for n in noise]
        else:
            noise = [tf.zeros(s, d) for s, d in shapes]
        if noise_masks is not None:
            noise = [n if m is None else n * tf.cast(m, n.dtype)
                     for n, m in zip(noise, noise_masks)]
        scale = 1.0 / tf.cast(expected_batch_size, tf.float32)
        grads = [(g + n) * tf.cast(scale, g.dtype) for g, n in zip(clipped_sums, noise)]
        if to_trainable is not None:
            grads, variables = to_trainable(grads, variables)
        if extra_gradients:
            # Keras sums the replicas' gradients: each replica adds its share.
            replicas = ctx.num_replicas_in_sync if ctx is not None else 1
            grads = [g + tf.cast(extra_gradients[id(v)], g.dtype) / replicas
                     if id(v) in extra_gradients else g for g, v in zip(grads, variables)]
        self._inside_private_step = True
        try:
            # The update (and the step counter) must wait for the gradients, whose
            # finiteness check may refuse the step.
            with tf.control_dependencies(grads):
                self.apply(grads, variables)
        finally:
            self._inside_private_step = False
        # Recorded once per global step (by the first replica), after the update.
        with tf.control_dependencies([self.iterations]):
            self._dp_ledger.record(self.mechanism(q), count=first_replica)

    def mechanism(self, sampling_probability):
        """(sigma, q, r): what the accountant composes for one step at rate q."""
        return (self.noise_multiplier, float(sampling_probability), self.num_projections)

    def drain_steps(self):
        """The (sigma, q, r, count) of the steps applied since the last drain (host side).

        ``tf_dp.keras`` models drain their optimizer into their accountant; a custom loop that
        calls ``apply_private`` without such a model must feed these to its own
        ``tf_dp.accounting.PrivacyAccountant``.
        """
        return self._dp_ledger.drain()

    def _next_sampler_seed(self):
        """Seed for the Poisson sampler of the next ``fit``: None (fresh OS entropy) unless
        the optimizer is seeded; then a new one per fit call, so a seeded debugging run still
        never replays the batches of an earlier fit."""
        calls = self._dp_fit_calls
        object.__setattr__(self, "_dp_fit_calls", calls + 1)
        if self.seed is None:
            return None
        return self.seed if calls == 0 else (self.seed * 1_000_003 + calls) % (2**63)

    def _dp_config(self):
        config = {k: getattr(self, k) for k in self._dp_keys}
        config["gradient_accumulation_steps"] = self.accumulation_steps
        return config


class JLMixin:
    """Turns a tf_dp optimizer class into its JL variant: per-example norms from
    ``num_projections`` JL projections (Bu et al. 2021) instead of exact norms."""

    def __init__(self, l2_norm_clip, noise_multiplier, num_projections=5, **kwargs):
        validate_num_projections(num_projections)
        kwargs.pop("norm_strategy", None)
        # Read by DPOptimizerMixin._init_dp, which the base __init__ calls.
        object.__setattr__(self, "_dp_pending_num_projections", num_projections)
        super().__init__(l2_norm_clip, noise_multiplier, **kwargs)

    def get_config(self):
        config = super().get_config()
        config["num_projections"] = self.num_projections
        config.pop("norm_strategy", None)
        return config
