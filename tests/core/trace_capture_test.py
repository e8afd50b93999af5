"""The ghost capture's batch-axis check costs one assertion per forward pass, not one per layer
(issue 14: the private step's first call traces and optimises every graph op; an assertion
per layer with an unknown batch was ~20 ops), and still stops a step whose layer is called on
a tensor whose leading axis is not the batch.
"""

import collections
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core import build_per_example_loss, clipped_sum
from tf_dp.core.private_step import PADDING_SCOPE
from tests import _reference

LOSS = build_per_example_loss("mse")


def _mlp():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])


class FoldsBatch(keras.Model):
    """Calls a Dense on (B * 2, 3): its leading axis is not the batch."""

    def __init__(self):
        super().__init__()
        self.inner = keras.layers.Dense(3)
        self.head = keras.layers.Dense(2)

    def call(self, x):
        h = self.inner(tf.reshape(x, [-1, 3]))
        return self.head(tf.reshape(h, [-1, 6]))


def _step(model):
    spec = (tf.TensorSpec([None, 6 if isinstance(model, FoldsBatch) else 5]),
            tf.TensorSpec([None, 2]))

    @tf.autograph.experimental.do_not_convert
    def step(x, y):
        return clipped_sum(model, x, y, None, LOSS, 1.0).grads

    return tf.function(step, input_signature=spec)


def test_one_batch_assertion_for_the_forward_pass():
    model = _mlp()
    graph = _step(model).get_concrete_function().graph
    ops = collections.Counter(op.type for op in graph.get_operations())
    # Three captured Dense layers, batch unknown: one assertion (was one per layer).
    assert ops["Assert"] == 1, ops


def test_a_layer_off_the_batch_axis_still_stops_the_step():
    model = FoldsBatch()
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    y = np.zeros((4, 2), "float32")
    model(x)
    with pytest.raises(tf.errors.InvalidArgumentError, match="batch axis first"):
        _step(model)(x, y)


@pytest.mark.parametrize("make", [FoldsBatch, _mlp], ids=["folds_batch", "mlp"])
def test_every_norm_waits_for_the_batch_assertion(make):
    # The CI failure this pins: the assertion ran after (raced with) the norms, so a layer
    # that folded the batch failed in a concat with a shape error instead of the assertion,
    # and norms of mixed examples could be formed before any check ran.
    model = make()
    model(np.zeros((4, 6 if isinstance(model, FoldsBatch) else 5), "float32"))
    graph = _step(model).get_concrete_function().graph
    asserts = [op for op in graph.get_operations() if op.type == "Assert"]
    # (not the ConcatV2 that pad a batch of fewer than MIN_ROWS rows, before the model)
    norms = [op for op in graph.get_operations() if op.type in ("Sqrt", "ConcatV2")
             and PADDING_SCOPE not in op.name]
    assert len(asserts) == 1 and norms
    for op in norms:
        assert asserts[0] in _reference.ancestor_ops(op), op.name


def test_backward_asserts_checks_left_by_a_context_used_without_capture():
    from tf_dp.core import ghost  # noqa: PLC0415

    layer = keras.layers.Dense(3)

    @tf.function(input_signature=[tf.TensorSpec([None, 6])])
    def step(x):
        with tf.GradientTape() as tape:
            ctx = ghost.GhostContext(tf.shape(x)[0], tape)
            ctx.check_batch(layer, tf.reshape(x, [-1, 3]))  # (2B, 3): not the batch
            loss = tf.reduce_sum(x)
        ghost.backward(ctx, tape, loss)
        return loss

    step(tf.zeros((0, 6)))  # B = 0: 2B = B, nothing to report
    with pytest.raises(tf.errors.InvalidArgumentError, match="batch axis first"):
        step(tf.ones((4, 6)))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
