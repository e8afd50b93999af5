"""`GradientSpectrum`: streams batch gradients along training into a `StreamingPCA`."""

from __future__ import annotations

import logging
import numbers
import time

import keras
import numpy as np
import tensorflow as tf

from tf_dp.analysis.spectra import StreamingPCA

_LOG = logging.getLogger("tf_dp")

NOT_PRIVATE_WARNING = (
    "tf_dp: GradientSpectrum streams the raw (unclipped, un-noised) mean gradient of its "
    "analysis data at every sampled step. If those data are private, the spectrum and the "
    "principal subspace are NOT covered by the model's differential-privacy guarantee, and "
    "a model trained in that subspace (ProjectedSGD) is not private either: give the callback "
    "public or proxy data, or keep its results to yourself.")


class GradientSpectrum(keras.callbacks.Callback):
    """The eigenvalue spectrum and top principal subspace of gradients along a training run.

    Every ``every_n_steps`` training steps it computes the mean gradient of the chosen
    variables on the next analysis batch, flattens and concatenates it (in the order of
    ``variable_paths``) into one vector ``g_t`` of length d, and streams it into a
    ``StreamingPCA`` (Frequent Directions, memory O(ℓ·d), no gradient kept)::

        g_t = ∂ mean_loss(analysis batch t) / ∂θ_chosen      at the weights after step t
        M   = (1/T) Σ_t g_t g_tᵀ                              (uncentred)
        spectrum.eigenvalues(), spectrum.components(k)        (= self.pca)

    This is the measurement of Li et al. (NeurIPS 2022, §4.2), who find that gradients along
    the trajectory concentrate in a few principal directions; ``ProjectedSGD`` re-trains in
    the top-k subspace. At each epoch's end the logs get ``gradient_spectrum_top<k>``, the
    share ``Σ_{i≤k} μ_i / tr M`` of the streamed energy in the top k directions so far.

    **Not private.** The analysis gradients are neither clipped nor noised. On private data
    everything this callback reports is outside the model's (ε, δ) guarantee (a one-time
    warning says so); on public or proxy data it is post-processing of the private weights.
    It is for research on public/proxy data.

    Cost: one forward and backward pass on an analysis batch per sampled step, plus the
    sketch's O(ℓ·d) update; ``every_n_steps`` thins it, and ``seconds`` is the wall time
    spent so far (compare it with the run's). Nothing runs unless the callback is passed to
    ``fit``.

    Args:
        x, y: analysis data (arrays with a leading example axis), scored with the model's
            compiled loss.
        sketch_size: ℓ, eigen-pairs kept (``StreamingPCA``); the top ℓ/2 are accurate.
        variables: variables, layers or layer names whose trainable weights are analysed;
            None (default): all trainable variables of the model.
        every_n_steps: take one gradient every this many training steps (≥ 1).
        batch_size: analysis examples per gradient, cycled through ``x`` in a new random order
            each pass; None: all of ``x`` every time.
        k_logged: the k values of the per-epoch ``gradient_spectrum_top<k>`` logs.

    Reference: Li, Liu, Hashimoto, Inan, Kulkarni, Lee, Thakurta, "When Does Differentially
    Private Learning Not Suffer in High Dimensions?", NeurIPS 2022, §4.2.
    """

    def __init__(self, x, y, sketch_size: int = 64, variables=None, every_n_steps: int = 1,
                 batch_size: int | None = None, k_logged=(1, 10)):
        super().__init__()
        if x is None or y is None:
            raise ValueError("`x` and `y` (the analysis data) are required, got "
                             f"x={type(x).__name__}, y={type(y).__name__}.")
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(f"`x` and `y` must hold the same number (>= 1) of examples, got "
                             f"{len(x)} and {len(y)}.")
        self.sketch_size = _positive_int(sketch_size, "sketch_size")
        self.every_n_steps = _positive_int(every_n_steps, "every_n_steps")
        if batch_size is not None:
            batch_size = _positive_int(batch_size, "batch_size")
            if batch_size > len(x):
                raise ValueError(f"`batch_size` must be <= the {len(x)} analysis examples, got "
                                 f"{batch_size}.")
        self.batch_size = batch_size
        if isinstance(k_logged, numbers.Integral):
            k_logged = (k_logged,)
        self.k_logged = tuple(_positive_int(k, "k_logged") for k in k_logged)
        self.x, self.y = x, y
        self._requested = variables
        self.pca = None
        self._variables = None
        self._order = np.zeros(0, dtype=np.int64)
        self._position = 0
        self._steps = 0
        self._gradient_fn = None
        self._warned = False
        self.seconds = 0.0  # wall time spent in on_train_batch_end (its cost to training)

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        if not self._warned:
            self._warned = True
            _LOG.warning(NOT_PRIVATE_WARNING)
        if self._variables is None:
            self._variables = self._resolve_variables()
            dim = sum(int(np.prod(v.shape)) for v in self._variables)
            self.pca = StreamingPCA(dim, self.sketch_size)

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._steps % self.every_n_steps == 0:
            start = time.perf_counter()
            self.pca.update(self.gradient())
            self.seconds += time.perf_counter() - start

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self.pca is None or self.pca.num_vectors == 0:
            return
        ratios = np.cumsum(self.pca.explained_variance_ratio(max(self.k_logged)))
        for k in self.k_logged:
            logs[f"gradient_spectrum_top{k}"] = float(ratios[min(k, len(ratios)) - 1])

    # ------------------------------------------------------------------ public
    @property
    def variable_paths(self) -> list:
        """Paths of the analysed variables (the order of the rows of ``pca.components``)."""
        if self._variables is None:
            raise ValueError("GradientSpectrum has not started: train with it first.")
        return [v.path for v in self._variables]

    def gradient(self) -> np.ndarray:
        """The flattened mean gradient of the chosen variables on the next analysis batch."""
        if self._variables is None:
            self._variables = self._resolve_variables()
        if self._gradient_fn is None:
            self._gradient_fn = tf.function(self._flat_gradient, reduce_retracing=True)
        x, y = self._next_batch()
        return self._gradient_fn(x, y).numpy()

    # ------------------------------------------------------------------ internals
    def _flat_gradient(self, x, y):
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=False)
            loss = self.model.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        grads = tape.gradient(loss, self._variables)
        missing = [v.path for v, g in zip(self._variables, grads) if g is None]
        if missing:
            raise ValueError(f"the loss has no gradient with respect to {missing}.")
        return tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)

    def _next_batch(self):
        if self.batch_size is None:
            return self.x, self.y
        if self._position + self.batch_size > len(self._order):
            # Analysis batches only, not a DP sampler: a fresh unseeded permutation per pass.
            self._order = np.random.default_rng().permutation(len(self.x))
            self._position = 0
        index = self._order[self._position:self._position + self.batch_size]
        self._position += self.batch_size
        return tf.gather(self.x, index), tf.gather(self.y, index)

    def _resolve_variables(self):
        model = self.model
        if model is None:
            raise ValueError("GradientSpectrum has no model yet: pass it to `fit(callbacks=...)` "
                             "or call `set_model` first.")
        if self._requested is None:
            chosen = list(model.trainable_variables)
        else:
            requested = self._requested
            if isinstance(requested, (str, keras.layers.Layer, keras.Variable)):
                requested = [requested]
            chosen = []
            for item in requested:
                if isinstance(item, str):
                    try:
                        item = model.get_layer(item)
                    except ValueError:
                        raise ValueError(f"`variables` entry {item!r} is not a layer of the "
                                         f"model {model.name!r}.") from None
                if isinstance(item, keras.layers.Layer):
                    chosen.extend(item.trainable_variables)
                elif isinstance(item, keras.Variable):
                    chosen.append(item)
                else:
                    raise ValueError("`variables` entries must be variables, layers or layer "
                                     f"names, got {item!r}.")
        if not chosen:
            raise ValueError("GradientSpectrum found no trainable variable to analyse.")
        return chosen


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)
