"""The vectorized fallback's own pfor converters (issue 14: vectorized <= 3x).

``tf.vectorized_map`` converts a per-example Conv2DBackpropFilter into a while loop over
the examples, a per-example MaxPoolGrad into one that oneDNN cannot pair with its forward
pool (Eigen's kernel, 15 of the tutorial CNN's 66 ms), and an unrolled recurrent kernel's
gradient into one outer product per time step and example and their AddN (1.8 of the
BiLSTM's 2.4 s). ``tf_dp.core.vmap`` overrides those converters while it vectorizes
(``_internals.pfor_converters``): one grouped filter gradient per chunk of examples, the
pool formed again next to its gradient, one product over the concatenated factors.
Pinned here: per-example gradients against float64 brute force one example at a time
(adversarial scales included), that the fast paths ran, that every case they do not take
(dilation, an output that is not the pool of the input, a sum of other things) goes to
TensorFlow's converter and stays exact, and that TensorFlow's converters are restored
however the block ends.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import _reference as ref
from tf_dp import _internals
from tf_dp.core import build_per_example_loss, vmap
from tf_dp.core.ghost.rules import conv

L = keras.layers
LOSS = build_per_example_loss("mse")
RNG = np.random.default_rng(31)

CASES = {
    # the tutorial CNN's shape of layers: strided "same" conv, pool 2/1, conv, pool
    "cnn": ((12, 12, 1), lambda: [
        L.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
        L.MaxPooling2D(2, 1), L.Conv2D(3, 3, activation="tanh"),
        L.MaxPooling2D(2, 2, padding="same"), L.Flatten(), L.Dense(2)]),
    "conv1d_causal": ((10, 3), lambda: [
        L.Conv1D(4, 3, padding="causal", activation="tanh"), L.MaxPooling1D(2),
        L.Conv1D(2, 2, strides=2), L.Flatten(), L.Dense(2)]),
    # dilation: no grouped filter gradient on CPU: TensorFlow's converter, still exact
    "dilated": ((9, 9, 2), lambda: [L.Conv2D(3, 3, dilation_rate=2), L.Flatten(),
                                    L.Dense(2)]),
    # unrolled recurrences: each kernel's gradient a sum of per-step products
    "recurrent": ((7, 3), lambda: [L.Bidirectional(L.LSTM(4, return_sequences=True)),
                                   L.GRU(3, return_sequences=True), L.SimpleRNN(2),
                                   L.Dense(2)]),
}


def _model(name, dtype):
    shape, layers = CASES[name]
    with ref.Precision(dtype):
        return keras.Sequential([keras.Input(shape)] + layers())


def _models(name):
    keras.utils.set_random_seed(9)
    m32 = _model(name, "float32")
    m64 = _model(name, "float64")
    m64.set_weights([w.astype(np.float64) for w in m32.get_weights()])
    return m32, m64


def _spied(monkeypatch):
    """Records which converter ran: ("ours" | "tensorflow", op type)."""
    calls = []
    for op_type, fn in list(vmap._PFOR_OVERRIDES.items()):
        def wrapped(pfor_input, original, fn=fn, op_type=op_type):
            def tensorflows(p):
                calls.append(("tensorflow", op_type))
                return original(p)
            n = len(calls)
            out = fn(pfor_input, tensorflows)
            if len(calls) == n:
                calls.append(("ours", op_type))
            return out
        monkeypatch.setitem(vmap._PFOR_OVERRIDES, op_type, wrapped)
    return calls


@pytest.mark.parametrize("traced", ["eager", "unknown_batch"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_vectorized_conv_and_pool_gradients_match_float64_brute_force(name, traced,
                                                                       monkeypatch):
    if not conv._grouped_gradient_works(tf.float32):
        pytest.skip("no grouped filter gradient in this TensorFlow build (oneDNN off)")
    monkeypatch.setattr(conv, "_GROUPED_CHUNK_BYTES", 1)  # chunks of one example: a loop
    calls = _spied(monkeypatch)
    m32, m64 = _models(name)
    n = 6
    x = RNG.normal(size=(n,) + CASES[name][0]).astype(np.float32)
    if name != "recurrent":  # (saturated gates: float32's and float64's forward differ)
        x[1] *= 1e4    # huge
    x[2] *= 1e-12  # tiny
    y = RNG.normal(size=(n, 2)).astype(np.float32)
    variables = m32.trainable_variables

    def fn(a, b):
        return vmap.per_example_gradients(m32, LOSS, a, b, None, variables,
                                          mode="vectorize")[0]

    if traced == "unknown_batch":
        fn = tf.function(fn, input_signature=[tf.TensorSpec((None,) + x.shape[1:]),
                                              tf.TensorSpec([None, 2])])
    got = [g.numpy().astype(np.float64).reshape(n, -1) for g in fn(x, y)]
    want = ref.per_example_gradients(m64, LOSS, x.astype(np.float64), y.astype(np.float64))
    for g, w in zip(got, want):
        w = w.reshape(n, -1)
        scale = np.max(np.abs(w), axis=1, keepdims=True)
        err = np.abs(g - w) / (scale + 1e-300)
        assert np.all((err <= 2e-5) | (np.abs(g - w) <= 1e-30)), np.max(err, axis=1)
    convs = sum(isinstance(layer, (L.Conv1D, L.Conv2D)) for layer in m32.layers)
    pools = sum(isinstance(layer, (L.MaxPooling1D, L.MaxPooling2D)) for layer in m32.layers)
    if name == "dilated":
        assert calls.count(("tensorflow", "Conv2DBackpropFilter")) == convs
    elif name == "recurrent":
        # both kernels of the two LSTMs, the GRU and the SimpleRNN
        assert calls.count(("ours", "AddN")) >= 8, calls
    else:
        assert calls.count(("ours", "Conv2DBackpropFilter")) == convs, calls
        assert calls.count(("ours", "MaxPoolGrad")) == pools, calls
        assert ("tensorflow", "MaxPoolGrad") not in calls


def test_a_pool_gradient_of_another_output_goes_to_tensorflows_converter(monkeypatch):
    # MaxPoolGrad given an "output" that is not the max pool of its input: the override
    # must not form the pool again (that would change the math); TensorFlow's converter.
    calls = _spied(monkeypatch)
    x = tf.constant(RNG.normal(size=(4, 1, 6, 6, 2)).astype(np.float32))
    other = tf.constant(RNG.normal(size=(4, 1, 5, 5, 2)).astype(np.float32))
    dy = tf.constant(RNG.normal(size=(4, 1, 5, 5, 2)).astype(np.float32))
    attrs = dict(ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="VALID")

    def one(args):
        xi, oi, di = args
        return tf.raw_ops.MaxPoolGrad(orig_input=xi, orig_output=oi * 2.0, grad=di, **attrs)

    with _internals.pfor_converters(vmap._PFOR_OVERRIDES):
        got = tf.function(lambda: tf.vectorized_map(one, (x, other, dy)))()
    want = tf.stack([one((x[i], other[i], dy[i])) for i in range(4)])
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert calls == [("tensorflow", "MaxPoolGrad")]


def test_sums_of_products_are_one_product_and_the_rest_is_added_exactly(monkeypatch):
    # Products taken, products with other adjoint flags (not taken), a plain tensor and one
    # the same for every example: integers, so every order of the sums is exact.
    calls = _spied(monkeypatch)
    a = tf.constant(RNG.integers(-3, 4, size=(5, 4, 1, 3)).astype(np.float32))
    b = tf.constant(RNG.integers(-3, 4, size=(5, 4, 1, 2)).astype(np.float32))
    c = tf.constant(RNG.integers(-3, 4, size=(5, 3, 2)).astype(np.float32))
    shared = tf.constant(RNG.integers(-3, 4, size=(3, 2)).astype(np.float32))

    def one(args):
        ai, bi, ci = args
        terms = [tf.matmul(ai[t], bi[t], transpose_a=True) for t in range(4)]
        # products with other adjoint flags (not taken: added as they are)
        terms += [tf.matmul(tf.transpose(ai[0]), bi[1]), tf.matmul(ci[:, :1], ci[:1, :])]
        terms += [ci, shared]
        return tf.add_n(terms)

    with _internals.pfor_converters(vmap._PFOR_OVERRIDES):
        got = tf.function(lambda: tf.vectorized_map(one, (a, b, c)))()
    want = tf.stack([one((a[i], b[i], c[i])) for i in range(5)])
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert ("ours", "AddN") in calls

    calls.clear()  # no two products: TensorFlow's converter
    with _internals.pfor_converters(vmap._PFOR_OVERRIDES):
        got = tf.function(lambda: tf.vectorized_map(
            lambda args: tf.add_n([args[2], args[2] * 2.0, shared]), (a, b, c)))()
    np.testing.assert_array_equal(got.numpy(), (c * 3.0 + shared).numpy())
    assert calls == [("tensorflow", "AddN")]


def test_tensorflows_converters_are_restored_however_the_block_ends():
    from tensorflow.python.ops.parallel_for import pfor

    registry = pfor._pfor_converter_registry
    before = {k: registry[k] for k in vmap._PFOR_OVERRIDES}
    with _internals.pfor_converters(vmap._PFOR_OVERRIDES):
        assert all(registry[k] is not before[k] for k in before)
        with _internals.pfor_converters(vmap._PFOR_OVERRIDES):  # nested: one installation
            pass
        assert all(registry[k] is not before[k] for k in before)
    assert {k: registry[k] for k in before} == before
    with pytest.raises(RuntimeError, match="boom"):
        with _internals.pfor_converters(vmap._PFOR_OVERRIDES):
            raise RuntimeError("boom")
    assert {k: registry[k] for k in before} == before


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
