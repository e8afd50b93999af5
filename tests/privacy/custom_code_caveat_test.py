"""Custom code on the batched-pass paths is said in the privacy report (session 13 audit).

A layer that mixes examples only for some input values, e.g. ``x + relu(max(x, axis=0) -
100)``, passes the first-batch independence probe; on the layer-formula (ghost) and JL paths
one example then moved the clipped sum by 7.6 C. The vectorized path runs every example
alone and stays within C. So:

* every strategy but the vectorized one notes PER_EXAMPLE_ASSUMED, naming the custom code
  (custom layer classes, Lambda functions, a subclassed model's call) whose per-example
  behaviour the guarantee then assumes; built-in layers alone, or the vectorized strategy,
  note nothing;
* under the vectorized strategy that layer's neighbouring clipped sums differ by at most C
  even for the example that triggers the mixing.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.core import build_per_example_loss, clipped_sum


class Gated(keras.layers.Layer):
    """Mixes examples only once some example has an input above 100."""

    def call(self, x):
        return x + keras.ops.relu(keras.ops.max(x, axis=0) - 100.0)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def _caveats(model, strategy):
    model = tf_dp.keras.make_private(model)
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0, norm_strategy=strategy), loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    model.fit(x, np.zeros((16, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    return [c for c in model.privacy_caveats if c.startswith("PER_EXAMPLE_ASSUMED")]


def _sequential(*middle):
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), *middle,
                             keras.layers.Dense(1)])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_custom_code_on_the_batched_path_is_noted_by_name():
    (gated,) = _caveats(_sequential(Gated()), "auto")
    assert "Gated" in gated and "vmap" in gated
    (lam,) = _caveats(_sequential(keras.layers.Lambda(lambda t: 2.0 * t, name="twice")),
                      tf_dp.JL(2))
    assert "Lambda(<lambda>)" in lam
    (sub,) = _caveats(Subclassed(), "auto")
    assert "Subclassed" in sub


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_built_in_layers_or_the_vectorized_path_note_nothing():
    assert _caveats(_sequential(keras.layers.LayerNormalization()), "auto") == []
    assert _caveats(_sequential(Gated()), "vmap") == []


def test_the_vectorized_path_bounds_the_value_dependent_mixing():
    keras.utils.set_random_seed(3)
    model = _sequential(Gated())
    loss = build_per_example_loss("mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 3)).astype(np.float32)
    x[2] = 1e4  # the example that switches the mixing on
    y = rng.normal(size=(6, 1)).astype(np.float32)
    clip = 0.05
    worst = 0.0
    for j in range(6):
        with_j, without_j = np.ones(6, np.float32), np.ones(6, np.float32)
        without_j[j] = 0.0
        sums = [clipped_sum(model, tf.constant(x), tf.constant(y), tf.constant(w), loss, clip,
                            norm_strategy="vmap").grads for w in (with_j, without_j)]
        diff = np.sqrt(sum(float(np.sum((a.numpy() - b.numpy()) ** 2))
                           for a, b in zip(*sums)))
        worst = max(worst, diff)
    assert worst <= clip * (1 + 1e-6), worst / clip


def test_class_weights_from_the_labels_break_the_bound_and_class_weight_is_noted():
    # Session 22: class weights computed from the training labels (inverse frequencies, the
    # common recipe) let one example change the weight of every example of its class. Five
    # examples of class 1 among 100: removing z raises the other four's weight from 10 to
    # 12.4, each unclipped, while z itself (opposite, clipped) takes away C.
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    loss = build_per_example_loss("mse")
    clip = 1.0
    labels = np.array([0] * 95 + [1] * 5)
    x = (labels == 1).astype(np.float32)[:, None]  # class 0: no gradient
    target = 0.999 * clip / (2 * 99 / (2 * 4))  # the four others at 0.999 C without z
    y = np.where(labels == 1, -target, 0.0).astype(np.float32)[:, None]
    y[95] = 100.0  # z: opposite, clipped

    def weighted_sum(rows):
        counts = np.bincount(labels[rows], minlength=2)
        w = (len(rows) / (2.0 * counts))[labels[rows]].astype(np.float32)
        out = clipped_sum(model, tf.constant(x[rows]), tf.constant(y[rows]), tf.constant(w),
                          loss, clip).grads
        return np.concatenate([np.ravel(g.numpy()) for g in out])

    everyone = np.arange(100)
    gap = np.linalg.norm(weighted_sum(everyone) - weighted_sum(everyone[everyone != 95]))
    assert gap > 1.7 * clip, gap / clip  # one example moved the sum by 1.77 C

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 3)).astype(np.float32), rng.integers(0, 2, 40).astype(np.int32)
    private = tf_dp.keras.make_private(keras.Sequential([keras.Input((3,)),
                                                         keras.layers.Dense(2)]))
    private.compile(optimizer=tf_dp.DPSGD(1.0, 1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match="class_weight was given"):
        private.fit(x, y, batch_size=8, class_weight={0: 0.67, 1: 2.0}, verbose=0)
    (noted,) = [c for c in private.privacy_caveats if c.startswith("CLASS_WEIGHT_ASSUMED")]
    assert "public" in noted
    assert private.privacy_report()["guarantee_holds"] is True  # the caller's word, noted
    again = tf_dp.keras.make_private(keras.Sequential([keras.Input((3,)),
                                                       keras.layers.Dense(2)]))
    again.compile(optimizer=tf_dp.DPSGD(1.0, 1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(UserWarning, match="class_weight was given"):
        again.train_on_batch(x[:8], y[:8], class_weight={0: 1.0, 1: 3.0})
    assert any(c.startswith("CLASS_WEIGHT_ASSUMED") for c in again.privacy_caveats)
    again.fit(x, y, batch_size=8, verbose=0)  # no class_weight: nothing new to note
    assert len([c for c in again.privacy_caveats if c.startswith("CLASS_WEIGHT")]) == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_label_missing_from_class_weight_does_not_stop_fit():
    # Session 22 audit: Keras' own class weighting stopped fit when a sampled batch held a
    # label absent from the dict: the stop told that example had been sampled. On arrays
    # the class weights are now sample weights, absent classes weighing 1.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = rng.integers(0, 2, size=40).astype(np.int64)
    y[:5] = 2  # a class of the model, absent from the dict
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((3,)),
                                                       keras.layers.Dense(3)]))
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=20, epochs=2, class_weight={0: 1.0, 1: 2.0}, verbose=0)
    assert int(model.optimizer.iterations) == 4


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_class_weight_on_a_sampler_or_dataset_is_refused_before_any_step():
    # Session 23 audit: for a PoissonSampler (or a dataset) Keras' own class weighting
    # gathered from a table as long as the dict's largest class; one label beyond it stopped
    # fit at the step that sampled it (after 6 of 60 steps), and only then.
    from tf_dp.data import PoissonSampler

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = rng.integers(0, 2, size=200).astype(np.int64)
    y[123] = 2
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((3,)),
                                                       keras.layers.Dense(3)]))
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    weights = {0: 1.0, 1: 2.0}
    sampler = PoissonSampler(x, y, expected_batch_size=10)
    for data in (sampler, sampler.dataset()):
        with pytest.raises(ValueError, match="class_weight"):
            model.fit(data, epochs=2, class_weight=weights, verbose=0)
    assert int(model.optimizer.iterations) == 0
    assert not any(c.startswith("CLASS_WEIGHT") for c in model.privacy_report()["caveats"])
    # The per-example weights the message points to train every step.
    weighted = PoissonSampler(x, y, sample_weight=np.where(y == 1, 2.0, 1.0),
                              expected_batch_size=10)
    model.fit(weighted, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == weighted.steps_per_epoch


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
