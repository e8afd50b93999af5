"""Keras models whose train step is private: DPModel, DPSequential and make_private."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from tf_dp.core import losses as losses_lib
from tf_dp.core import private_step, reparam
from tf_dp.keras.privacy_callback import PrivacyCallback
from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin

_FIXED_BATCH_NOTE = (
    "tf_dp: training on a dataset of fixed (shuffled) batches. The privacy accounting "
    "assumes Poisson sampling; for a guarantee that matches it, pass arrays to fit() (Poisson "
    "sampling is then done for you) or a tf_dp.data.PoissonSampler.")


class DPTrainMixin:
    """The private train step, mixed into a Keras model class.

    ``compile`` requires a tf_dp DP optimizer. ``fit`` on arrays Poisson-samples each batch
    (each example independently with rate q = batch_size / N; the batch size is then an
    expected size) so that training matches the privacy accounting. ``train_step`` clips
    each example's gradient, and the optimizer adds noise once per logical step.
    """

    #: delta at which ``epsilon`` is reported; set by ``make_private(model, delta=...)``.
    privacy_delta = 1e-5
    #: when set, ``fit`` stops before the step that would exceed this epsilon.
    target_epsilon = None

    # ------------------------------------------------------------------ privacy budget

    @property
    def accountant(self):
        """The model's ``tf_dp.accounting.PrivacyAccountant`` (every private step so far)."""
        if getattr(self, "_dp_accountant", None) is None:
            from tf_dp.accounting import PrivacyAccountant

            self._dp_accountant = PrivacyAccountant()
        return self._dp_accountant

    @property
    def exact_clipping_accountant(self):
        """The steps of JL optimizers accounted as exact clipping, for comparison only."""
        if getattr(self, "_dp_exact_accountant", None) is None:
            from tf_dp.accounting import PrivacyAccountant

            self._dp_exact_accountant = PrivacyAccountant()
        return self._dp_exact_accountant

    def epsilon(self, delta: float = None, exact_clipping: bool = False) -> float:
        """Epsilon spent so far at ``delta`` (default: the model's ``privacy_delta``).

        With ``exact_clipping=True``: what the JL steps would have cost with exact norms.
        When the accountant cannot reach its stated accuracy (very small JL ``r``), the
        returned value is its valid but looser upper bound, with a warning.
        """
        from tf_dp.accounting import AccuracyError

        delta = self.privacy_delta if delta is None else delta
        accountant = self.exact_clipping_accountant if exact_clipping else self.accountant
        try:
            return accountant.epsilon(delta)
        except AccuracyError as err:
            warnings.warn(f"tf_dp: epsilon could not be computed to the accountant's accuracy; "
                          f"reporting its upper bound {err.upper:g} ({err}).", stacklevel=2)
            return float(err.upper)

    def get_config(self):
        config = super().get_config()
        config["tf_dp"] = {"privacy_delta": self.privacy_delta,
                           "target_epsilon": self.target_epsilon,
                           "accountant": self.accountant.get_config(),
                           "exact_clipping_accountant":
                               self.exact_clipping_accountant.get_config()}
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        extra = config.pop("tf_dp", None)
        model = super().from_config(config, custom_objects=custom_objects)
        if extra:
            from tf_dp.accounting import PrivacyAccountant

            model.privacy_delta = extra["privacy_delta"]
            model.target_epsilon = extra["target_epsilon"]
            model._dp_accountant = PrivacyAccountant.from_config(extra["accountant"])
            if extra.get("exact_clipping_accountant"):
                model._dp_exact_accountant = PrivacyAccountant.from_config(
                    extra["exact_clipping_accountant"])
        return model

    # ------------------------------------------------------------------ compile / fit

    def compile(self, optimizer=None, loss=None, loss_weights=None, **kwargs):
        if optimizer is None or not isinstance(optimizer, DPOptimizerMixin):
            raise TypeError(
                "A private model needs a tf_dp differentially private optimizer "
                "(tf_dp.DPSGD, tf_dp.DPAdam, tf_dp.DPAdamW, ...), got `optimizer`="
                f"{optimizer!r}. A plain optimizer would train without privacy.")
        # XLA cannot compile every fallback (vectorized_map / map_fn); keep it opt-in.
        kwargs.setdefault("jit_compile", False)
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, **kwargs)
        names = getattr(self, "output_names", None)
        self._dp_loss = losses_lib.build_per_example_loss(loss, loss_weights, names)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, sample_weight=None,
            steps_per_epoch=None, poisson_sampling: bool = True, **kwargs):
        """Keras ``fit`` with Poisson sampling for array inputs (see the class docstring).

        Extra argument:
          poisson_sampling: for array inputs, sample each batch by Poisson sampling with rate
            q = batch_size / N (default True). False trains on shuffled fixed batches; the
            training output then notes that the accounting assumes Poisson sampling.
        """
        from tf_dp.data.poisson import PoissonSampler

        opt = self.optimizer
        if not isinstance(opt, DPOptimizerMixin):
            raise TypeError("Call compile() with a tf_dp DP optimizer before fit().")
        k = opt.accumulation_steps
        sampler = x if isinstance(x, PoissonSampler) else None
        if sampler is None and poisson_sampling and _is_array_like(x):
            if validation_split and validation_data is None:
                (x, y, sample_weight), validation_data = _split_validation(
                    x, y, sample_weight, validation_split)
                validation_split = 0.0
            # Keras semantics: `batch_size` is one micro-batch; a logical batch is k of them.
            sampler = PoissonSampler(x, y, sample_weight=sample_weight,
                                     expected_batch_size=(batch_size or 32) * k, seed=opt.seed)
        if sampler is not None:
            self._dp_set_sampling(sampler.expected_batch_size, sampler.sampling_probability,
                                  poisson=True)
            privacy = PrivacyCallback(sampler.sampling_probability)
            if self._dp_budget_spent(privacy):
                return self.history if getattr(self, "history", None) else None
            callbacks = [privacy] + list(callbacks or [])
            return super().fit(sampler.dataset(), epochs=epochs, verbose=verbose, shuffle=False,
                               callbacks=callbacks, validation_data=validation_data,
                               steps_per_epoch=steps_per_epoch or sampler.steps_per_epoch,
                               **kwargs)
        if _is_array_like(x):
            # Keras semantics: `batch_size` (default 32) is one micro-batch; each Keras batch
            # is one logical batch of k of them.
            batch_size = (batch_size or 32) * k
        self._dp_set_sampling(None, None, poisson=False)
        warnings.warn(_FIXED_BATCH_NOTE, stacklevel=2)
        print(_FIXED_BATCH_NOTE)
        q = _fixed_batch_rate(x, batch_size, validation_split, kwargs.pop("dataset_size", None))
        privacy = PrivacyCallback(q, assumes_poisson=False)
        if self._dp_budget_spent(privacy):
            return self.history if getattr(self, "history", None) else None
        callbacks = [privacy] + list(callbacks or [])
        return super().fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                           callbacks=callbacks, validation_split=validation_split,
                           validation_data=validation_data, shuffle=shuffle,
                           sample_weight=sample_weight, steps_per_epoch=steps_per_epoch,
                           **kwargs)

    def _dp_budget_spent(self, privacy):
        if privacy.remaining_steps(self) == 0:
            print(f"tf_dp: the privacy budget (target epsilon {self.target_epsilon:g} at delta "
                  f"{self.privacy_delta:g}) is spent; not training.")
            return True
        return False

    def _dp_set_sampling(self, expected_micro_batch_size, sampling_probability, poisson):
        state = (expected_micro_batch_size, sampling_probability, poisson)
        if getattr(self, "_dp_sampling", None) != state:
            # The expected batch size is baked into the traced step: retrace on change.
            self.train_function = None
        self._dp_sampling = state

    # ------------------------------------------------------------------ the private step

    def train_step(self, data):
        """One logical private step on ``data`` (a logical batch).

        With ``gradient_accumulation_steps = k`` the batch is processed as k micro-batches in
        a sequential loop (only one micro-batch's activations live at a time); their clipped
        sums are added up and the optimizer adds noise once.
        """
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        opt = self.optimizer
        if not isinstance(opt, DPOptimizerMixin):
            raise TypeError("A private model must be compiled with a tf_dp DP optimizer.")
        plan = reparam.gradient_plan(self)
        plan.update_carriers()  # RGP: carriers of this step, from the historical update
        variables = plan.privatized
        k = opt.accumulation_steps
        if k == 1:
            grads = self._dp_micro_step(x, y, sample_weight, variables)
        else:
            grads = self._dp_accumulate(x, y, sample_weight, variables, k)
        _refuse_data_dependent_losses(self)
        expected, _, _ = getattr(self, "_dp_sampling", (None, None, False))
        if expected is None:
            expected = _global_count(private_step.batch_size_of(x))
        opt.apply_private(grads, variables, expected, noise_masks=plan.noise_masks,
                          to_trainable=plan.to_trainable,
                          extra_gradients=_regularization_gradients(plan.trainable))
        return self.get_metrics_result()

    def _dp_micro_step(self, x, y, sample_weight, variables):
        opt = self.optimizer
        result = private_step.clipped_sum(
            self, x, y, sample_weight, self._dp_loss, opt.l2_norm_clip, variables=variables,
            norm_strategy=opt.norm_strategy, num_projections=opt.num_projections,
            seed=opt.step_seed())
        self._dp_update_metrics(x, y, result, sample_weight)
        return result.grads

    def _dp_accumulate(self, x, y, sample_weight, variables, k):
        n = tf.shape(tf.nest.flatten(x)[0])[0]

        def part(structure, j):
            lo, hi = (j * n) // k, ((j + 1) * n) // k
            return tf.nest.map_structure(lambda t: None if t is None else t[lo:hi], structure)

        def body(j, *acc):
            grads = self._dp_micro_step(part(x, j), part(y, j), part(sample_weight, j),
                                        variables)
            return (j + 1, *[a + g for a, g in zip(acc, grads)])

        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        out = tf.while_loop(lambda j, *acc: j < k, body, (tf.constant(0), *zeros),
                            parallel_iterations=1)
        return list(out[1:])

    def _dp_update_metrics(self, x, y, result, sample_weight):
        y_pred = result.y_pred
        if sample_weight is not None:
            # Rows of weight 0 (Poisson padding) are not examples: keep them out of every
            # metric, including Keras' unweighted `metrics=`.
            keep = tf.reshape(sample_weight, [tf.shape(result.losses)[0], -1])[:, 0] > 0
            included = tf.reduce_sum(tf.cast(keep, result.losses.dtype))
            take = lambda s: tf.nest.map_structure(
                lambda t: None if t is None else tf.boolean_mask(t, keep), s)
            x, y, y_pred, sample_weight = take(x), take(y), take(y_pred), take(sample_weight)
        else:
            included = tf.cast(tf.shape(result.losses)[0], result.losses.dtype)
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(result.losses), included)
        self._loss_tracker.update_state(mean_loss, sample_weight=included)
        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def compile_from_config(self, config):
        """Re-compiles a loaded model (``compile`` is overridden, so Keras would skip it)."""
        from keras.src.saving import serialization_lib

        config = serialization_lib.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)


def _fixed_batch_rate(x, batch_size, validation_split, dataset_size):
    """q = logical batch / N for fixed batches (the accounting then assumes Poisson)."""
    if isinstance(x, tf.data.Dataset):
        spec_leaf = tf.nest.flatten(x.element_spec)[0]
        batch = spec_leaf.shape[0]
        if batch is None:
            first = next(iter(x.take(1)))
            batch = int(tf.nest.flatten(first)[0].shape[0])
        if dataset_size is None:
            card = int(x.cardinality())
            if card <= 0:
                raise ValueError(
                    "Cannot tell the data set size from this dataset (unknown or infinite "
                    "cardinality): pass `dataset_size=N` to fit() so epsilon can be computed.")
            dataset_size = card * batch
    else:
        if not _is_array_like(x):
            if dataset_size is None or batch_size is None:
                raise ValueError("For this input type pass `dataset_size=N` and `batch_size` "
                                 "to fit() so epsilon can be computed.")
        n = dataset_size or len(tf.nest.flatten(x)[0])
        dataset_size = int(n * (1.0 - (validation_split or 0.0)))
        batch = batch_size or 32
    return min(1.0, batch / dataset_size)


def _refuse_data_dependent_losses(model):
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if layer._losses:
            raise ValueError(
                f"Layer {layer.name!r} added a loss during the forward pass (add_loss or "
                "activity_regularizer). Such losses depend on the data but are not per-example, "
                "so they cannot be clipped; remove them for private training (weight "
                "regularizers are fine).")


def _regularization_gradients(variables):
    """{id(v): gradient of v's weight regulariser}: data independent, added after noise."""
    out = {}
    for v in variables:
        r = getattr(v, "regularizer", None)
        if r is None:
            continue
        with tf.GradientTape() as tape:
            tape.watch(v.value)
            penalty = r(v.value)
        out[id(v)] = tape.gradient(penalty, v.value)
    return out


def _global_count(local):
    local = tf.cast(local, tf.float32)
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return local


def _is_array_like(x):
    if isinstance(x, dict):
        return all(_is_array_like(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_array_like(v) for v in x)
    return isinstance(x, (np.ndarray, tf.Tensor)) or (hasattr(x, "__array__") and not isinstance(
        x, tf.data.Dataset))


def _split_validation(x, y, sample_weight, split):
    n = len(tf.nest.flatten(x)[0])
    cut = int(n * (1.0 - split))
    head = lambda s: tf.nest.map_structure(lambda a: None if a is None else a[:cut], s)
    tail = lambda s: tf.nest.map_structure(lambda a: None if a is None else a[cut:], s)
    val = (tail(x), tail(y)) if sample_weight is None else (tail(x), tail(y),
                                                             tail(sample_weight))
    return (head(x), head(y), head(sample_weight)), val


@keras.saving.register_keras_serializable(package="tf_dp")
class DPModel(DPTrainMixin, keras.Model):
    """A Keras ``Model`` that trains with differential privacy.

    Use it like ``keras.Model``: functional (``DPModel(inputs, outputs)``) or subclassed
    (define ``call``). Compile it with a tf_dp optimizer; ``fit`` then clips each example's
    gradient (exact norms: layer formulas where known, vectorized per-example gradients for
    other layers), adds Gaussian noise once per logical step and Poisson-samples array inputs.

    Reference: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    """


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSequential(DPTrainMixin, keras.Sequential):
    """A ``keras.Sequential`` that trains with differential privacy (see ``DPModel``)."""


def make_private(model: keras.Model, delta: float = 1e-5,
                 target_epsilon: float = None) -> keras.Model:
    """Returns a private version of ``model`` sharing its layers and weights.

    Functional and Sequential models become ``DPModel`` / ``DPSequential`` over the same
    layers (no copy of weights). A subclassed model gets a private train step installed on
    a new class derived from its own, so its ``call`` and state are kept.

    Args:
      model: a Keras model (functional, Sequential or subclassed).
      delta: the delta at which epsilon is reported in the training logs, in (0, 1).
      target_epsilon: optional budget; ``fit`` stops before the step that would exceed it.

    Raises:
      TypeError: if ``model`` is not a ``keras.Model``.
      ValueError: if ``delta`` or ``target_epsilon`` is out of range.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"`delta` must be in (0, 1), got {delta!r}.")
    if target_epsilon is not None and not (isinstance(target_epsilon, (int, float))
                                           and target_epsilon > 0):
        raise ValueError(f"`target_epsilon` must be > 0, got {target_epsilon!r}.")
    private = _private_version(model)
    private.privacy_delta = float(delta)
    private.target_epsilon = None if target_epsilon is None else float(target_epsilon)
    return private


def _private_version(model):
    if isinstance(model, DPTrainMixin):
        return model
    if isinstance(model, keras.Sequential):
        private = DPSequential(model.layers, name=model.name)
        if model.built and not private.built and model.inputs:
            private.build(model.inputs[0].shape)
        return private
    from keras.src.models.functional import Functional

    if type(model) is Functional:
        return DPModel(inputs=model.inputs, outputs=model.outputs, name=model.name)
    # Subclassed model: derive a private class so the instance keeps its own call/state.
    cls = type(model)
    private_cls = type(f"Private{cls.__name__}", (DPTrainMixin, cls), {})
    model.__class__ = private_cls
    return model
