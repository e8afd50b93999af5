"""What every tf_dp optimizer shares: the DP configuration, noise once per logical step,
normalisation by the expected batch size, and the refusal to run outside a private step."""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import keras
import tensorflow as tf

from tf_dp import _internals, _validation
from tf_dp.core import ledger as ledger_lib
from tf_dp.core import clipping, gaussian, norm_strategies, private_step, randomness

#: Folded into a step's noise seed for the count noise of adaptive clipping (gradient noise
#: folds in the variable indices 0, 1, ...).
_COUNT_NOISE_STREAM = 2**31 - 1

_PLAIN_MODEL_MESSAGE = (
    "{name} is a differentially private optimizer but was called by a plain Keras train "
    "step, which would train WITHOUT privacy (no per-example clipping). Wrap the model with "
    "`tf_dp.keras.make_private(model)` (or build it as tf_dp.keras.DPSequential / DPModel) "
    "before compile().")


#: The DP arguments every tf_dp optimizer takes, documented once (``{{dp_args}}`` in a
#: class docstring is replaced by this text, as Keras does for its optimizers).
DP_ARGS_DOC = """l2_norm_clip: the clipping norm C (> 0).
      noise_multiplier: sigma, the noise std in units of C (>= 0; 0 gives no privacy and
        warns).
      gradient_accumulation_steps: k >= 1 micro-batches per logical step; clipped sums are
        accumulated and noise is added once per logical step (Anil et al. accumulate to
        mega-batches this way; Keras' own accumulation, which would add noise k times, is
        never used).
      norm_strategy: how per-example norms are computed: "auto" (ghost rules where a layer
        has one, exact vectorized gradients elsewhere; the default), "ghost", "vectorized",
        or ``tf_dp.JL(r)`` (r JL projections, Bu et al. 2021, accounted as the JL
        mechanism). A ``tf_dp.NormStrategy`` or its name.
      num_projections: r, only with ``norm_strategy="jl"`` (same as ``tf_dp.JL(r)``).
      adaptive_clipping: None (C fixed) or ``tf_dp.AdaptiveClipping(target_quantile, ...)``:
        C starts at ``l2_norm_clip`` and follows a quantile of the per-example norms (Andrew
        et al. 2021) through a noised count released each step. ``noise_multiplier`` stays
        the accounted noise of the whole step (gradient and count); the gradient gets the
        slightly larger ``(sigma^-2 - (2 sigma_b)^-2)^-1/2``. Exact norms only.
      per_layer_clipping: None (one clip for the whole gradient), "equal", "dimension" or
        {layer name: weight}: each layer's part of an example's gradient is clipped to
        ``C sqrt(share)`` (shares equal, proportional to the layer's size, or to the
        weights), so the whole stays within C and the accounting is unchanged. Exact norms
        only.
      seed: debugging only. None (default): noise from fresh OS entropy, never saved or
        replayed. An int makes the noise a public function of the seed, so the privacy
        guarantee does not hold (a warning says so)."""


#: per thread (tf.distribute traces each replica's step in a thread of its own): the ids of
#: the optimizers whose apply_private is being called by tf_dp's train step
#: (``sampled_by_train_step``)
_STEP_SAMPLING = threading.local()


@contextlib.contextmanager
def sampled_by_train_step(optimizer):
    """While tf_dp's train step calls ``optimizer.apply_private``: its q is the one the step
    took from fit's sampler or declaration (already noted), not the caller's word."""
    active = getattr(_STEP_SAMPLING, "optimizers", None)
    if active is None:
        active = _STEP_SAMPLING.optimizers = set()
    added = id(optimizer) not in active
    active.add(id(optimizer))
    try:
        yield
    finally:
        if added:
            active.discard(id(optimizer))


#: the caveat of steps whose q < 1 came from the caller of ``apply_private``, not from tf_dp's
#: own train step (which takes it from its Poisson sampler or notes fit's declaration).
_DECLARED_Q_CAVEAT = (
    "DECLARED_SAMPLING: apply_private(sampling_probability={q:g}) was called by code other "
    "than tf_dp's train step: the batches are accounted as Poisson samples at that rate, "
    "which tf_dp did not draw and cannot check.")


#: the caveat of steps applied under XLA by code other than tf_dp's train step
_XLA_CUSTOM_LOOP_CAVEAT = (
    "XLA_BATCH_SHAPES: apply_private ran under XLA (jit_compile=True) in code other than "
    "tf_dp's train step (a custom loop), whose batch shapes tf_dp cannot know. XLA's CPU "
    "kernels round a row differently for different batch sizes, so an example crafted to "
    "make its gradient mostly rounding moves with the number of other examples in its "
    "batch, and one example can then move the update by more than the clipping norm. Run "
    "every step at one batch shape (a tf_dp.data.PoissonSampler with pad_to=...) and "
    "outside XLA, or use fit().")


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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and "{{dp_args}}" in cls.__doc__:
            cls.__doc__ = cls.__doc__.replace("{{dp_args}}", DP_ARGS_DOC)

    def __init__(self, l2_norm_clip, noise_multiplier, *args, gradient_accumulation_steps=1,
                 norm_strategy="auto", num_projections=None, seed=None,
                 adaptive_clipping=None, per_layer_clipping=None, **kwargs):
        # Validated before the Keras base __init__, so a bad argument never half-builds one.
        sigma = _validation.noise_multiplier(noise_multiplier)
        clip = _validation.l2_norm_clip(l2_norm_clip, sigma)
        k = 1 if gradient_accumulation_steps is None else _validation.positive_int(
            gradient_accumulation_steps, "gradient_accumulation_steps")
        strategy = norm_strategies.get(norm_strategy, num_projections)
        seed = _validation.seed(seed)
        adaptive = _adaptive_clipping(adaptive_clipping)
        per_layer = clipping.validate_per_layer(per_layer_clipping)
        if strategy.num_projections is not None and (adaptive or per_layer):
            what = "adaptive_clipping" if adaptive else "per_layer_clipping"
            raise ValueError(f"`{what}` needs exact per-example norms; `norm_strategy` "
                             f"{strategy!r} estimates them (the JL accounting covers flat "
                             "clipping only). Use norm_strategy='auto'.")
        if adaptive is not None and math.isinf(clip):
            raise ValueError("`adaptive_clipping` needs a finite initial `l2_norm_clip`.")
        if adaptive is not None and adaptive.count_stddev is not None:
            clipping.gradient_noise_multiplier(sigma, adaptive.count_stddev)  # 2 sigma_b > z
        kwargs.setdefault("name", type(self).__name__)
        super().__init__(*args, **kwargs)
        # Accumulation is done inside the private train step (one logical batch is split into
        # k micro-batches), never by Keras, so noise is added once per step on any number of
        # replicas and learning-rate schedules count logical steps.
        object.__setattr__(self, "_dp_params", {
            "l2_norm_clip": clip, "noise_multiplier": sigma, "norm_strategy": strategy,
            "num_projections": strategy.num_projections, "accumulation_steps": k,
            "seed": seed, "adaptive_clipping": adaptive, "per_layer_clipping": per_layer})
        object.__setattr__(self, "_dp_clip_var", None)
        # Plain Python attributes holding tf.Variables: Keras and tf.train.Checkpoint track
        # neither, so no saved file holds the key, the counters or the ledger.
        object.__setattr__(self, "_dp_noise", randomness.SecretStream("noise", seed))
        object.__setattr__(self, "_dp_jl", randomness.SecretStream("jl", seed))
        object.__setattr__(self, "_dp_ledger", ledger_lib.StepLedger())
        object.__setattr__(self, "_dp_fit_calls", 0)
        self._inside_private_step = False
        if seed is not None:
            randomness.warn_seeded(type(self).__name__, seed)
        clip_args = {k: kwargs.get(k) for k in ("clipnorm", "global_clipnorm", "clipvalue")
                     if kwargs.get(k) is not None}
        if clip_args:
            warnings.warn(f"tf_dp: {type(self).__name__} got {clip_args}: Keras applies it to the "
                          "noised mean gradient (post-processing, harmless to privacy), not per "
                          "example. Per-example clipping is `l2_norm_clip`.", UserWarning,
                          stacklevel=3)
        if sigma == 0:
            warnings.warn(f"tf_dp: {type(self).__name__} has `noise_multiplier=0`: its updates "
                          "are not private (epsilon is infinite). Use it only as a non-private "
                          "reference.", UserWarning, stacklevel=3)

    @classmethod
    def for_target_epsilon(cls, target_epsilon, delta, epochs, batch_size, dataset_size,
                           l2_norm_clip, **kwargs):
        """The optimizer whose noise multiplier is the smallest that keeps ``epochs`` of
        ``fit(x, y, batch_size=batch_size)`` on ``dataset_size`` examples within
        (``target_epsilon``, ``delta``) (Opacus' ``make_private_with_epsilon``).

        The run is the one ``fit`` does on arrays: Poisson sampling at q = batch_size * k / N
        (k = ``gradient_accumulation_steps``) and ``max(1, round(1 / q))`` logical steps per
        epoch; JL strategies are calibrated for the JL mechanism. Pair it with
        ``make_private(model, target_epsilon=...)`` so that a longer run still stops there.

        ``batch_size`` may be a ``tf_dp.schedules.PiecewiseBatchSize`` (as in ``fit``): the
        phases are composed as the run takes them, with ``steps_per_epoch`` (a keyword,
        default from the first phase's q, as ``fit``) steps per epoch.

        ``kwargs`` are the optimizer's other arguments (learning rate, norm_strategy, ...).
        """
        from tf_dp.schedules import PiecewiseBatchSize

        from tf_dp import accounting

        target_epsilon = _validation.positive_epsilon(target_epsilon)
        delta = _validation.delta(delta)
        n = _validation.positive_int(dataset_size, "dataset_size")
        steps_per_epoch = kwargs.pop("steps_per_epoch", None)
        schedule = batch_size if isinstance(batch_size, PiecewiseBatchSize) else None
        b = (schedule.batch_sizes[0] if schedule is not None
             else _validation.positive_int(batch_size, "batch_size"))
        k = _validation.positive_int(kwargs.get("gradient_accumulation_steps") or 1,
                                     "gradient_accumulation_steps")
        if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
            raise ValueError(f"`epochs` must be a number > 0, got {epochs!r}.")
        if "noise_multiplier" in kwargs:
            raise ValueError("`noise_multiplier` is what for_target_epsilon computes; give "
                             "`target_epsilon` or use the constructor.")
        q = min(1.0, b * k / n)
        per_epoch = (max(1, round(1.0 / q)) if steps_per_epoch is None
                     else _validation.positive_int(steps_per_epoch, "steps_per_epoch"))
        steps = int(math.ceil(epochs * per_epoch))
        if schedule is not None:
            phases = schedule.scaled(k).phases(steps)
            q = [min(1.0, size / n) for size, _ in phases]
            steps = [count for _, count in phases]
        if issubclass(cls, JLAlias):
            strategy = norm_strategies.JL(kwargs.get("num_projections", 5))
        else:
            strategy = norm_strategies.get(kwargs.get("norm_strategy", "auto"),
                                           kwargs.get("num_projections"))
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, sampling_probability=q, steps=steps,
            num_projections=strategy.num_projections)
        return cls(l2_norm_clip, sigma, **kwargs)

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
    #: r of a JL norm strategy; None means exact per-example norms.
    num_projections = _dp_param("num_projections")
    accumulation_steps = _dp_param("accumulation_steps")
    seed = _dp_param("seed")
    adaptive_clipping = _dp_param("adaptive_clipping")
    per_layer_clipping = _dp_param("per_layer_clipping")
    del _dp_param

    # -- the clip norm ---------------------------------------------------------------------

    def build(self, var_list):
        super().build(var_list)
        if self.adaptive_clipping is not None and self._dp_clip_var is None:
            # The current C of adaptive clipping: an optimizer variable (saved with the
            # optimizer's state and restored with it; it is post-processing of released
            # values), one value on every replica.
            var = self.add_variable(
                shape=(), dtype="float64", aggregation="only_first_replica",
                initializer=keras.initializers.Constant(self.l2_norm_clip),
                name="tf_dp_adaptive_clip")
            object.__setattr__(self, "_dp_clip_var", var)

    @tf.autograph.experimental.do_not_convert
    def current_clip(self):
        """C of the next step: ``l2_norm_clip`` or, with adaptive clipping, its current
        value (a float64 tensor)."""
        if self.adaptive_clipping is None:
            return self.l2_norm_clip
        if self._dp_clip_var is None:
            raise RuntimeError("Adaptive clipping: build the optimizer (compile and fit the "
                               "model, or optimizer.build(variables)) before reading C.")
        return tf.identity(self._dp_clip_var)

    @tf.autograph.experimental.do_not_convert
    def clip_spec(self, variables, clip=None):
        """What ``NormStrategy.clipped_sum`` clips ``variables`` to: C (``clip`` or
        ``current_clip()``), or a per-layer ``ClipSpec``."""
        clip = self.current_clip() if clip is None else clip
        if self.per_layer_clipping is None:
            return clip
        return clipping.per_layer_spec(self.per_layer_clipping, list(variables), clip)

    def clipping_description(self) -> str:
        """How this optimizer clips, in words (for the privacy report)."""
        if self.per_layer_clipping is not None:
            split = self.per_layer_clipping
            text = (f"per layer (shares {split!r} of C^2), total C = {self.l2_norm_clip:g}")
        else:
            text = f"flat, C = {self.l2_norm_clip:g}"
        a = self.adaptive_clipping
        if a is not None:
            sb = ("expected batch / 20" if a.count_stddev is None else f"{a.count_stddev:g}")
            text += (f"; adaptive from that initial C (Andrew et al. 2021): target quantile "
                     f"{a.target_quantile:g}, learning rate {a.learning_rate:g}, count noise "
                     f"std {sb}; noise_multiplier {self.noise_multiplier:g} is the joint "
                     "noise of gradient and count, as accounted")
        return text

    @property
    def seeded(self) -> bool:
        """True if noise is derived from a user seed (the privacy guarantee does not hold)."""
        return self._dp_params["seed"] is not None

    # -- the private update ----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if not self._inside_private_step:
            raise RuntimeError(_PLAIN_MODEL_MESSAGE.format(name=type(self).__name__))
        return super().apply(grads, trainable_variables)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        """Keras' sum of the replicas' gradients (TensorFlow backend), skipped for a private
        update: ``apply_private`` summed the replicas' float64 sums and the noise already,
        and every replica holds the total. Keras would add float32 values after the noise."""
        if self._inside_private_step:
            return list(grads_and_vars)
        return super()._all_reduce_sum_gradients(grads_and_vars)

    @tf.autograph.experimental.do_not_convert
    def next_jl_seed(self):
        """A fresh secret (2,) seed for one logical step's JL directions."""
        return self._dp_jl.next_seed()

    @tf.autograph.experimental.do_not_convert
    def apply_private(self, clipped_sums, variables, expected_batch_size,
                      sampling_probability=None, carrier=None, extra_gradients=None,
                      clip_count=None, clip=None, gradient_snr=None, phase=None):
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
          carrier: the step's ``tf_dp.core.GradientCarrier`` when ``variables`` are its
            privatized variables: its noise masks multiply the noise (LSG's frozen entries
            get none) and it maps the noised gradients to the trainable variables
            (post-processing, e.g. RGP's reconstruction). None: plain variables.
          extra_gradients: optional {id(variable): gradient} of data-independent terms
            (weight regularisers), added after privatisation.
          clip_count: adaptive clipping only (required then): this replica's
            ``tf_dp.core.clipping.centred_count`` of the logical batch.
          clip: the C the sums were clipped to (default ``current_clip()``); the noise is
            scaled by it.
          phase: with a batch-size schedule, ``sampling_probability`` is the sequence of the
            phases' q (Python numbers) and ``phase`` the index of this step's (an int tensor);
            the step is recorded at that q.
          gradient_snr: None, "private" or "exact": also return this step's gradient
            signal-to-noise ratio (Anil et al. 2021, §5.2.1), ``||sum||/||noise||`` over the
            privatized coordinates of the global logical batch (``gradient_snr`` below).

        Returns:
          None, or the gradient SNR (a float32 scalar) when ``gradient_snr`` is given.
        """
        if gradient_snr not in (None, "private", "exact"):
            raise ValueError(f"`gradient_snr` must be None, 'private' or 'exact', got "
                             f"{gradient_snr!r}.")
        if phase is None:
            qs = [1.0 if sampling_probability is None else float(sampling_probability)]
        elif isinstance(sampling_probability, (list, tuple)) and sampling_probability:
            qs = [float(q) for q in sampling_probability]
        else:
            raise ValueError("`phase` needs `sampling_probability` as the sequence of the "
                             f"phases' q, got {sampling_probability!r}.")
        if (isinstance(expected_batch_size, (int, float))
                and not expected_batch_size > 0):  # a tensor is the caller's to check
            raise ValueError(f"`expected_batch_size` must be positive, got "
                             f"{expected_batch_size!r}.")
        for q in qs:
            if not 0 < q <= 1:
                raise ValueError(f"`sampling_probability` must be in (0, 1], got "
                                 f"{sampling_probability!r}.")
        private_step.check_no_jit_scope("apply_private")
        ctx = tf.distribute.get_replica_context()
        replica_id = ctx.replica_id_in_sync_group if ctx is not None else 0
        # Keras sums the replicas' gradients: only the first replica adds noise.
        first_replica = tf.cast(tf.equal(tf.cast(replica_id, tf.int32), 0), tf.float32)
        adaptive = self.adaptive_clipping
        if adaptive is not None and clip_count is None:
            raise ValueError("Adaptive clipping: `clip_count` (the centred count of unclipped "
                             "examples, tf_dp.core.clipping.centred_count) is required.")
        clip = self.current_clip() if clip is None else clip
        sigma = self.noise_multiplier
        if adaptive is not None:
            count_stddev = adaptive.count_noise(expected_batch_size)
            sigma = clipping.gradient_noise_multiplier(sigma, count_stddev)
        shapes = [(v.shape, g.dtype) for g, v in zip(clipped_sums, variables)]
        seed = self._dp_noise.next_seed() if self.noise_multiplier > 0 else None
        if seed is not None:
            stddev = clipping.as_float64(sigma) * clipping.as_float64(clip)
            noise = private_step.gaussian_noise(shapes, stddev, seed, after=clipped_sums)
            noise = [n * tf.cast(first_replica, n.dtype) for n in noise]
        else:
            noise = [tf.zeros(s, d) for s, d in shapes]
        if carrier is not None:
            noise = [n if m is None else n * tf.cast(m, n.dtype)
                     for n, m in zip(noise, carrier.noise_masks)]
        # Sum, noise and normalisation in the sums' dtype (float64 from the private step:
        # ghost.SUM_DTYPE), then ONE rounding to the variables' dtype: a function of the
        # noised sum alone (post-processing), never a rounding of the sum before its noise.
        noised = [g + n for g, n in zip(clipped_sums, noise)]
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            # The replicas' sums (the first one's with the noise) are added here, in the
            # sums' dtype, and every replica gets the same total; Keras' own sum of the
            # replicas' gradients, float32 values added after the noise, is skipped
            # (_all_reduce_sum_gradients below).
            noised = ctx.all_reduce(tf.distribute.ReduceOp.SUM, noised)
        scale = 1.0 / tf.cast(expected_batch_size, tf.float64)
        grads = [tf.cast(g * tf.cast(scale, g.dtype), v.dtype)
                 for g, v in zip(noised, variables)]
        snr = None
        if gradient_snr is not None:
            masks = (carrier.noise_masks if carrier is not None else [None] * len(noise))
            # "private" from the released (rounded) update itself, times the public divisor.
            released = [tf.cast(g, tf.float64) / scale for g in grads]
            snr = gradient_snr_of(gradient_snr, clipped_sums, noise, masks, sigma, clip,
                                  ctx, released=released)
        sum_variables = list(variables)
        if carrier is not None:
            grads, variables = carrier.to_trainable(grads, variables)
        if extra_gradients:
            # Data independent, the same on every replica (whose gradients are not summed).
            grads = [g + tf.cast(extra_gradients[id(v)], g.dtype)
                     if id(v) in extra_gradients else g for g, v in zip(grads, variables)]
        # Recorded once per global step, in every process's ledger: by the first replica of
        # each worker (of the one process without multi-worker training). The record waits
        # for the step's gradients and the update waits for the record: an update (or the
        # adaptive clip's noised count) never runs unrecorded, even when an op of the step
        # fails after it; a step whose data never came records nothing. (The record ran
        # unordered with the update: a step aborted by the end of a dataset was recorded
        # without an update, session 24; one aborted after the update could go unrecorded.)
        first_on_worker = _first_replica_on_this_worker(ctx, replica_id)
        if id(self) not in getattr(_STEP_SAMPLING, "optimizers", ()):
            # A q < 1 that tf_dp's own train step did not take from its sampler (a custom
            # loop over apply_private): the caller's word (session 21 audit: fixed batches
            # declared at q = 0.25 were reported as Poisson samples, without a caveat).
            for q in qs:
                if q < 1.0:
                    self._dp_ledger.note(self.mechanism(q), _DECLARED_Q_CAVEAT.format(q=q))
                if _internals.compiling_with_xla():
                    # tf_dp's own step notes this where its batches' shapes follow the data
                    # (session 24 audit: a custom loop under jit_compile=True had no caveat
                    # while one example moved the update by 1.33 C).
                    self._dp_ledger.note(self.mechanism(q), _XLA_CUSTOM_LOOP_CAVEAT)
        for q in qs:
            # Sums traced under XLA in another function (session 24 review) are checked when
            # the steps are read, not here: this function may have been traced before them
            # (session 25 audit: a warm-up step first, then 1.33 C with no caveat).
            self._dp_ledger.applies_to(self.mechanism(q), [*sum_variables, *variables])
        with tf.control_dependencies(grads):
            if phase is None:
                recorded = self._dp_ledger.record(self.mechanism(qs[0]), count=first_on_worker)
            else:
                recorded = self._dp_ledger.record_one_of([self.mechanism(q) for q in qs], phase,
                                                         count=first_on_worker)
        self._inside_private_step = True
        try:
            # The update (and the step counter) must wait for the gradients, whose
            # finiteness check may refuse the step, and for the record.
            with tf.control_dependencies([*grads, recorded]):
                self.apply(grads, variables)
        finally:
            self._inside_private_step = False
        if adaptive is not None:
            with tf.control_dependencies([recorded]):
                self._update_clip(clip, clip_count, count_stddev, expected_batch_size, seed,
                                  first_replica, ctx)
        return snr

    def _update_clip(self, clip, clip_count, count_stddev, expected_batch_size, seed,
                     first_replica, ctx):
        """Adaptive clipping: releases the noised count (noise once, by the first replica,
        from the step's secret seed) and moves C."""
        count = clipping.as_float64(clip_count)
        if seed is not None:
            # A seed of its own, folded from the step's: independent of the gradient noise.
            # (all 128 bits of the step's seed: randomness.fold_seed, not stateless_fold_in)
            count_seed = randomness.fold_seed(seed, _COUNT_NOISE_STREAM)
            draw = gaussian.normal([], count_seed)  # not tf.random's: it caps at 5.68
            count += draw * clipping.as_float64(count_stddev) * tf.cast(first_replica,
                                                                         tf.float64)
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            count = ctx.all_reduce(tf.distribute.ReduceOp.SUM, count)
        new = self.adaptive_clipping.update(clip, count, expected_batch_size)
        self._dp_clip_var.assign(new)

    def mechanism(self, sampling_probability):
        """(sigma, q, r): what the accountant composes for one step at rate q (with adaptive
        clipping sigma is the joint noise of gradient and count, see ``tf_dp.core.clipping``;
        per-layer clipping is the same mechanism as flat clipping at C)."""
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

    def get_config(self):
        config = super().get_config()
        config.update({"l2_norm_clip": self.l2_norm_clip,
                       "noise_multiplier": self.noise_multiplier,
                       "gradient_accumulation_steps": self.accumulation_steps,
                       **self.norm_strategy.get_config(), "seed": self.seed,
                       "adaptive_clipping": (None if self.adaptive_clipping is None
                                             else self.adaptive_clipping.get_config()),
                       "per_layer_clipping": self.per_layer_clipping})
        return config


class JLAlias:
    """Makes ``DP<Name>JL(C, sigma, num_projections=r)`` the optimizer ``DP<Name>`` with
    ``norm_strategy=tf_dp.JL(r)`` (``DPSGDJL``, ``DPAdamJL``, ``DPAdamWJL``): per-example
    norms from r JL projections (Bu et al. 2021, Algorithm 1)::

        v_1..v_r ~ N(0, I)              # fresh each step, from a secret stream
        P_ij = <grad l_i, v_j>          # from ghost factors, or materialised gradients
        M_i  = sqrt(mean_j P_ij^2)      # E[M_i^2] = ||grad l_i||^2
        g    = (sum_i g_i / max(1, M_i / C) + N(0, sigma^2 C^2 I)) / E

    Works for any Keras model; close to non-private memory where ghost rules cover the large
    weights (the others' per-example gradients are materialised, as by the vectorized
    fallback). Each step is accounted as the JL mechanism (the clipped contribution has norm
    <= C (sqrt(r / chi2_r) + tau), tau = 2^-20 for the rounding of the sums), whose epsilon is
    much larger than exact clipping's for small r: use small r for fast hyper-parameter
    search and large r (or exact clipping) for the final run.

    Reference: Bu, Gopi, Kulkarni, Lee, Shen, Tantipongpipat, "Fast and Memory Efficient
    Differentially Private-SGD via JL Projections", NeurIPS 2021.
    """

    def __init__(self, l2_norm_clip, noise_multiplier, num_projections=5, **kwargs):
        given = kwargs.pop("norm_strategy", "jl")
        if given not in ("jl", norm_strategies.JL(num_projections)):
            raise ValueError(f"`norm_strategy` of {type(self).__name__} is JL("
                             f"num_projections), got {given!r}; use the exact optimizer.")
        super().__init__(l2_norm_clip, noise_multiplier,
                         norm_strategy=norm_strategies.JL(num_projections), **kwargs)


def _adaptive_clipping(value):
    """None, an ``AdaptiveClipping``, or its config dict (from ``get_config``)."""
    if value is None or isinstance(value, clipping.AdaptiveClipping):
        return value
    if isinstance(value, dict):
        try:
            return clipping.AdaptiveClipping(**value)
        except TypeError as err:
            raise ValueError(f"`adaptive_clipping` config {value!r} is not valid: {err}") from None
    raise ValueError("`adaptive_clipping` must be None or tf_dp.AdaptiveClipping(...), got "
                     f"{value!r}.")


def _first_replica_on_this_worker(ctx, replica_id):
    """1.0 on the first replica of this worker (process), else 0.0.

    Under MultiWorkerMirroredStrategy every worker keeps its own step ledger (a local
    variable), so each records the global step once; one process records it once.
    """
    if ctx is None:
        return tf.constant(1.0)
    per_worker = max(1, ctx.num_replicas_in_sync // _internals.num_workers(ctx.strategy))
    local = tf.math.floormod(tf.cast(replica_id, tf.int32), per_worker)
    return tf.cast(tf.equal(local, 0), tf.float32)


def gradient_snr_of(kind, clipped_sums, noise, masks, sigma, clip, ctx=None, released=None):
    """The gradient signal-to-noise ratio of one logical step (Anil et al., "Large-Scale
    Differentially Private BERT", 2021, §5.2.1), over the privatized coordinates:

    * "exact": ``||S|| / ||n||``, S the clipped sum of the global logical batch and n the
      noise actually added. ``||S||`` is computed from the *un-noised* sum: a statistic of the
      private data that no noise protects (outside the guarantee; for analysis on public or
      proxy data).
    * "private": ``sqrt(max(0, ||S + n||^2 - E||n||^2)) / sqrt(E||n||^2)`` with
      ``E||n||^2 = sigma^2 C^2 d`` (d the noised coordinates): post-processing of the noised
      update only, so covered by the guarantee; an unbiased estimate of ``||S||^2`` in the
      numerator, noisy when the SNR is small. Given ``released`` (the update as released,
      rounded to the variables' dtype, times the public divisor; all-reduced already),
      ``S + n`` is read from it: a function of the released update alone (session 22 audit:
      it was read from the float64 sum before that rounding).

    Both are ``inf`` without noise. Under a distribution strategy the sums are all-reduced
    first (one more all-reduce of the gradient: enable it for analysis runs).
    """
    f64 = lambda t: tf.cast(t, tf.float64)
    replicas = ctx.num_replicas_in_sync if ctx is not None else 1
    reduce = ((lambda t: ctx.all_reduce(tf.distribute.ReduceOp.SUM, t)) if replicas > 1
              else (lambda t: t))
    sq = lambda ts: tf.add_n([tf.reduce_sum(tf.square(f64(t))) for t in ts]) if ts else (
        tf.constant(0.0, tf.float64))
    if kind == "exact":
        signal_sq = sq([reduce(g) for g in clipped_sums])
        noise_sq = reduce(sq(noise))
    else:
        noisy_sq = (sq(released) if released is not None
                    else sq([reduce(g + n) for g, n in zip(clipped_sums, noise)]))
        dims = tf.add_n([f64(tf.size(g)) if m is None
                         else tf.reduce_sum(f64(tf.ones_like(g)) * f64(m))
                         for g, m in zip(clipped_sums, masks)])
        noise_sq = clipping.as_float64(sigma) ** 2 * clipping.as_float64(clip) ** 2 * dims
        signal_sq = tf.maximum(noisy_sq - noise_sq, 0.0)
    ratio = tf.where(noise_sq > 0, tf.sqrt(signal_sq) / tf.sqrt(
        tf.where(noise_sq > 0, noise_sq, 1.0)), tf.constant(float("inf"), tf.float64))
    return tf.cast(ratio, tf.float32)
