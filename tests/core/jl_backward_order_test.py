"""Small per-example gradients are formed before the backward pass goes on (factors.py,
``_formed_before_the_backward_goes_on``).

A LayerNormalization scale's per-example gradient (B, d) is made from its output gradient
and its normalised input, both (B, T, d). Nothing made the executor form it early: in the
11.4M Transformer's JL step it waited until the end of the backward pass, holding both for
every normalisation (peak 350.8 -> 297.0 MiB at batch 64, docs/scaling.md §7). Now the ops
that read such an output gradient in the backward pass wait for the per-example gradient.

* Graph: for JL and exact norms, the per-example gradients of a later layer's small weights
  are ancestors of an earlier layer's (the backward pass waits for them).
* No control edge where it could close a cycle (a per-example gradient reading something
  downstream of its output gradient), and values unchanged (brute force in jl_test,
  jl_memory_test and the ghost tests; here one step against the reference once more).
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests import _reference
from tf_dp.core import build_per_example_loss, clipped_sum
from tf_dp.core.ghost.factors import FactorOptions, MaterialisedFactors, factors_for
from tf_dp.core.ghost.terms import DirectTerm

L = keras.layers


def _model(f="float32"):
    keras.utils.set_random_seed(3)
    x = keras.Input((6, 8), dtype=f)
    z = L.Dense(16, name="first", dtype=f)(x)
    z = L.LayerNormalization(name="ln1", dtype=f)(z)
    z = L.Dense(16, activation="tanh", name="middle", dtype=f)(z)
    z = L.LayerNormalization(name="ln2", dtype=f)(z)
    z = L.GlobalAveragePooling1D(dtype=f)(z)
    return keras.Model(x, L.Dense(2, name="last", dtype=f)(z))


def _traced_factors(strategy):
    model = _model()
    x = np.random.default_rng(0).normal(size=(5, 6, 8)).astype("float32")
    _, captured = _reference.traced_factors(model, strategy, x, np.zeros((5, 2), "float32"),
                                            tf.constant([1, 2], tf.int64))
    return model, captured


@pytest.mark.parametrize("strategy", [tf_dp.JL(3), tf_dp.Auto()], ids=["jl3", "exact"])
def test_the_backward_pass_waits_for_later_layers_small_gradients(strategy):
    model, factors = _traced_factors(strategy)
    per = {}
    for v, f in zip(model.trainable_variables, factors):
        layer = v.path.split("/")[0]
        if isinstance(f, MaterialisedFactors):
            per.setdefault(layer, []).append((v.path, f.per))
    # Small weights with direct per-example gradients in forward order (biases, scales).
    order = [name for name in ("first", "ln1", "middle", "ln2", "last") if name in per]
    assert {"first", "ln1", "ln2", "last"} <= set(order), sorted(per)
    for earlier, later in zip(order, order[1:]):
        for path_e, p_e in per[earlier]:
            waits_for = _reference.ancestor_ops(p_e.op)
            for path_l, p_l in per[later]:
                assert p_l.op in waits_for, f"{path_e} is formed without waiting for {path_l}"


def test_no_control_edge_that_could_close_a_cycle():
    w = tf.Variable(tf.ones([3]))

    @tf.function(autograph=False)
    def fn(x):
        z = x * w
        dz = 2.0 * tf.ones_like(z)  # stands for an output gradient
        downstream = dz * 3.0  # the backward pass goes on from it
        safe = factors_for(w, [DirectTerm(z, lambda g: g * x)], lambda t: dz,
                           FactorOptions(exact_norms=False))
        # Reads `downstream`: a control edge from it to dz's readers would close a cycle.
        unsafe = factors_for(w, [DirectTerm(z, lambda g: g * downstream)], lambda t: dz,
                             FactorOptions(exact_norms=False))
        assert safe.per.op in downstream.op.control_inputs
        assert unsafe.per.op not in downstream.op.control_inputs
        return safe.per, unsafe.per, downstream

    x = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    safe, unsafe, downstream = fn(x)  # runs: no cycle
    np.testing.assert_array_equal(safe.numpy(), 2.0 * x.numpy())
    np.testing.assert_array_equal(unsafe.numpy(), 12.0 * np.ones((2, 3)))
    np.testing.assert_array_equal(downstream.numpy(), 6.0 * np.ones((2, 3)))


@pytest.mark.parametrize("strategy", ["auto", "jl"])
def test_a_layer_applied_to_its_own_output_forms_no_cycle(strategy):
    # The gradient at inner's first output is formed by the backward pass through its second
    # call, which reads the second call's output gradient: that reader must not wait for the
    # bias's per-example gradient, which needs the first one (the session 13 audit's
    # "nodes in a cycle"). The clipped sum is brute force's.
    keras.utils.set_random_seed(4)
    inner = keras.layers.Dense(3, activation="tanh")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inner(inner(inputs))))
    x = np.random.default_rng(5).normal(size=(5, 3)).astype(np.float32)
    y = np.random.default_rng(6).normal(size=(5, 2)).astype(np.float32)
    loss_fn = build_per_example_loss("mse")
    extra = dict(norm_strategy="jl", num_projections=2, seed=tf.constant([3, 4], tf.int64)) \
        if strategy == "jl" else {}
    fn = tf.function(lambda a, b: clipped_sum(model, a, b, None, loss_fn, 1e9, **extra).grads)
    got = fn(tf.constant(x), tf.constant(y))  # ran: no cycle
    _, want = _reference.clipped_sum_reference(model, loss_fn, x, y, 1e9)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-6)
    private = tf_dp.keras.make_private(model)
    private.compile(optimizer=tf_dp.DPSGD(1.0, 1.0, norm_strategy=strategy if strategy ==
                                          "auto" else tf_dp.JL(2)), loss="mse")
    private.train_on_batch(x, y)


def test_eager_factors_are_unchanged():
    w = tf.Variable(tf.ones([3]))
    x = tf.constant([[1.0, 2.0, 3.0]])
    f = factors_for(w, [DirectTerm(x * w, lambda g: g * x)], lambda t: tf.ones_like(x),
                    FactorOptions(exact_norms=False))
    np.testing.assert_array_equal(f.per.numpy(), x.numpy())


@pytest.mark.parametrize("r", [1, 4])
def test_jl_norms_still_those_of_brute_force(r):
    model = _model("float64")
    x = np.random.default_rng(1).normal(size=(4, 6, 8))
    y = np.random.default_rng(2).normal(size=(4, 2))
    loss_fn = build_per_example_loss("mse")
    seed = tf.constant([7, r], tf.int64)
    per = _reference.per_example_gradients(model, loss_fn, x, y)
    dirs = _reference.jl_step_directions(model, x, r, seed)
    want = np.array([[sum(float(np.sum(p[i] * np.asarray(d))) for p, d in zip(per, dirs[j]))
                      for i in range(len(x))] for j in range(r)])
    fn = tf.function(lambda a, b, s: clipped_sum(
        model, a, b, None, loss_fn, 1e9, norm_strategy="jl", num_projections=r,
        seed=s).norms)
    got = fn(tf.constant(x), tf.constant(y), seed).numpy()
    np.testing.assert_allclose(got, np.sqrt(np.mean(want ** 2, axis=0)), rtol=1e-9)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
