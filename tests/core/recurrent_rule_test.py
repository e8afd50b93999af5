"""The LSTM / GRU / SimpleRNN ghost rule (tf_dp/core/ghost/rules/recurrent.py) against
float64 brute force.

The rule runs its recurrence time-major with its own gradient (``tf.custom_gradient``): a
backward loop differentiates one step at a time and writes each step's gradient at the
input projections (the factor ``dz`` of the kernel, recurrent kernel and bias). A wrong
backward loop changes ``dz`` and therefore the norms and clipped sums, which are compared
here with per-example gradients of the plain Keras layers (one example at a time, no rule):
masks (both output conventions), ``go_backwards``, ``return_sequences`` both ways, stacked
and bidirectional layers, an unknown batch and a batch of one. The forward outputs under
the rule must equal the Keras layer's, and the factors' norm bounds must bound the norm of
what the weighted sum adds.
"""

import logging
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import _reference as ref
from tf_dp.core import build_per_example_loss, clipped_sum, ghost

L = keras.layers
_IDS = np.array([[3, 1, 4, 0, 0, 0], [0, 0, 2, 7, 1, 8], [5, 0, 9, 2, 6, 5],
                 [0, 0, 0, 0, 0, 0]], dtype="int32")


def _seq(*layers, inp=(6, 3), dtype="float64"):
    return keras.Sequential([keras.Input(inp, dtype=dtype), *layers, L.Flatten(), L.Dense(2)])


def _ids(*layers):
    return keras.Sequential([keras.Input((6,), dtype="int32"),
                             L.Embedding(10, 3, mask_zero=True), *layers, L.Dense(2)])


# (id, builder, float input or None for _IDS)
CASES = [
    ("lstm_last", lambda: _seq(L.LSTM(4)), True),
    ("lstm_backwards_sequences", lambda: _seq(L.LSTM(4, go_backwards=True,
                                                      return_sequences=True)), True),
    ("lstm_no_bias_relu", lambda: _seq(L.LSTM(3, use_bias=False, activation="relu",
                                              recurrent_activation="hard_sigmoid",
                                              return_sequences=True)), True),
    ("gru_backwards", lambda: _seq(L.GRU(4, go_backwards=True)), True),
    ("gru_reset_before_sequences", lambda: _seq(L.GRU(3, reset_after=False,
                                                      return_sequences=True,
                                                      go_backwards=True)), True),
    ("gru_no_bias", lambda: _seq(L.GRU(3, use_bias=False, return_sequences=True)), True),
    ("simple_rnn_sequences", lambda: _seq(L.SimpleRNN(4, return_sequences=True)), True),
    ("stacked", lambda: _seq(L.LSTM(3, return_sequences=True),
                             L.GRU(3, return_sequences=True, go_backwards=True),
                             L.SimpleRNN(2)), True),
    ("bidirectional_stacked", lambda: _seq(
        L.Bidirectional(L.LSTM(3, return_sequences=True)), L.Bidirectional(L.LSTM(2))), True),
    ("masked_lstm_stacked", lambda: _ids(L.LSTM(3, return_sequences=True, go_backwards=True),
                                         L.LSTM(3)), False),
    ("masked_zero_output", lambda: _ids(
        L.LSTM(3, return_sequences=True, zero_output_for_mask=True),
        L.GRU(3, go_backwards=True, return_sequences=True, zero_output_for_mask=True),
        L.SimpleRNN(2, zero_output_for_mask=True)), False),
    ("masked_bidirectional", lambda: _ids(
        L.Bidirectional(L.GRU(3, return_sequences=True, reset_after=False)),
        L.Bidirectional(L.LSTM(2))), False),
]


_Precision = ref.Precision


def _make(build, float_input, dtype, batch=4, scale=1.0):
    keras.utils.set_random_seed(0)
    with _Precision(dtype):
        model = build()
    rng = np.random.default_rng(3)
    x = (scale * rng.normal(size=(batch, 6, 3))).astype(dtype) if float_input else _IDS[:batch]
    y = rng.normal(size=(batch, 2)).astype(dtype)
    return model, x, y


def _recurrent_layers(model):
    return [layer for layer in ghost.capturable_layers(model)
            if isinstance(layer, (L.LSTM, L.GRU, L.SimpleRNN))]


def _check(res, model, x, y, rtol):
    loss_fn = build_per_example_loss("mse")
    per = ref.per_example_gradients(model, loss_fn, x, y)
    norms = ref.per_example_norms(per)
    clip = float(np.float32(np.median(norms)))
    w = ref.clip_weights(norms, clip)
    sums = [np.tensordot(w, g, axes=1) for g in per]
    got_norms, got_sums = res(clip)
    np.testing.assert_allclose(np.asarray(got_norms), norms, rtol=rtol)
    scale = max(float(np.max(np.abs(s))) for s in sums)
    for got, want, v in zip(got_sums, sums, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * scale,
                                   err_msg=v.path)


def _no_fallback(caplog):
    failed = [r.getMessage() for r in caplog.records if "ghost rule" in r.getMessage()]
    assert not failed, failed


@pytest.mark.parametrize("case_id,build,float_input", CASES, ids=[c[0] for c in CASES])
def test_clipped_sum_matches_brute_force(case_id, build, float_input, caplog):
    caplog.set_level(logging.WARNING, logger="tf_dp")
    model, x, y = _make(build, float_input, "float64")
    assert _recurrent_layers(model)
    loss_fn = build_per_example_loss("mse")

    def res(clip):
        out = clipped_sum(model, x, y, None, loss_fn, clip, norm_strategy="ghost")
        return out.norms.numpy(), [g.numpy() for g in out.grads]

    _check(res, model, x, y, rtol=1e-9)
    _no_fallback(caplog)


@pytest.mark.parametrize("case_id", ["lstm_backwards_sequences", "bidirectional_stacked",
                                     "masked_zero_output"])
def test_float32_matches_brute_force(case_id, caplog):
    caplog.set_level(logging.WARNING, logger="tf_dp")
    _, build, float_input = next(c for c in CASES if c[0] == case_id)
    model, x, y = _make(build, float_input, "float32")
    loss_fn = build_per_example_loss("mse")

    def res(clip):
        out = clipped_sum(model, x, y, None, loss_fn, clip, norm_strategy="ghost")
        return out.norms.numpy(), [g.numpy() for g in out.grads]

    _check(res, model, x, y, rtol=2e-5)
    _no_fallback(caplog)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case_id", ["bidirectional_stacked", "masked_bidirectional",
                                     "masked_zero_output"])
def test_traced_with_unknown_batch(case_id, batch, caplog):
    caplog.set_level(logging.WARNING, logger="tf_dp")
    _, build, float_input = next(c for c in CASES if c[0] == case_id)
    model, x, y = _make(build, float_input, "float64", batch=batch)
    loss_fn = build_per_example_loss("mse")
    x_spec = tf.TensorSpec([None, *x.shape[1:]], x.dtype)

    def res(clip):
        @tf.function(input_signature=[x_spec, tf.TensorSpec([None, 2], tf.float64)])
        def step(x, y):
            out = clipped_sum(model, x, y, None, loss_fn, clip, norm_strategy="ghost")
            return out.norms, out.grads

        norms, grads = step(tf.constant(x), tf.constant(y))
        return norms.numpy(), [g.numpy() for g in grads]

    _check(res, model, x, y, rtol=1e-9)
    _no_fallback(caplog)


@pytest.mark.parametrize("case_id,build,float_input", CASES, ids=[c[0] for c in CASES])
def test_forward_and_input_gradient_equal_keras(case_id, build, float_input):
    """The rule computes the layers' outputs, and its custom gradient the gradient Keras
    computes (here at the layers' inputs, in float64)."""
    model, x, y = _make(build, float_input, "float64")
    x = tf.constant(x)
    # Only the recurrent layers run their rules: the gradient reaches the input (or the
    # embedding table) through their custom gradients.
    layers = _recurrent_layers(model)
    source = x if float_input else model.layers[0].embeddings.value

    def run(captured):
        with tf.GradientTape() as tape:
            tape.watch(source)
            if captured:
                with ghost.capture(layers, x.shape[0], tape):
                    out = model(x, training=True)
            else:
                out = model(x, training=True)
            loss = tf.reduce_sum(tf.square(out - y) * np.array([1.0, -2.0]))
        return out.numpy(), tf.convert_to_tensor(tape.gradient(loss, source)).numpy()

    out_rule, grad_rule = run(True)
    out_keras, grad_keras = run(False)
    np.testing.assert_allclose(out_rule, out_keras, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad_rule, grad_keras, rtol=1e-10, atol=1e-13)


def _op_counts(fn, *args):
    """Op types of a traced function with all its nested functions (loop bodies)."""
    graph_def = fn.get_concrete_function(*args).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    counts = {}
    for n in nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return counts


@pytest.mark.parametrize("activation,sigmoids", [("tanh", 3), ("relu", 6)])
def test_default_lstm_backward_is_written_out(activation, sigmoids):
    """With the Keras default activations the backward loop uses the hand-written step
    backward (from the kept gates): the only sigmoids are the forward loop's
    three gates. Another activation keeps the tape, which recomputes the step's gates in
    the backward loop (three more). The values of both are pinned by the tests above
    (``lstm_last`` and the masked cases take the written-out backward,
    ``lstm_no_bias_relu`` the tape)."""
    keras.utils.set_random_seed(0)
    model = _seq(L.LSTM(4, activation=activation), dtype="float32")
    loss_fn = build_per_example_loss("mse")

    @tf.function
    def step(x, y):
        return clipped_sum(model, x, y, None, loss_fn, 1.0, norm_strategy="ghost").grads

    counts = _op_counts(step, tf.zeros([3, 6, 3]), tf.zeros([3, 2]))
    assert counts.get("Sigmoid", 0) == sigmoids, counts.get("Sigmoid")


def test_bounds_cover_what_the_sum_adds():
    """float32, inputs from tiny to huge: each weight's bound is at least the float64 norm
    of the per-example gradient its factors describe."""
    keras.utils.set_random_seed(0)
    model = _seq(L.Bidirectional(L.LSTM(4, return_sequences=True)), L.GRU(3),
                 dtype="float32")
    x = np.random.default_rng(5).normal(size=(5, 6, 3)).astype(np.float32)
    x[1] *= 1e4
    x[2] *= 1e-20
    x[3, 2] = 3e3
    y = np.ones((5, 2), np.float32)
    with tf.GradientTape() as tape:
        with ghost.capture(ghost.capturable_layers(model), 5, tape) as ctx:
            pred = model(x, training=True)
        total = tf.reduce_sum(tf.square(pred - y))
    factors = ghost.backward(ctx, tape, total)
    covered = 0
    for v in model.trainable_variables:
        f = factors.get(id(v))
        if f is None or "dense" in v.path:
            continue
        covered += 1
        if getattr(f, "per", None) is not None:
            per = np.asarray(f.per, np.float64).reshape(5, -1)
        else:
            per = np.einsum("btd,btp->bdp", np.asarray(f.a, np.float64),
                            np.asarray(f.g, np.float64)).reshape(5, -1)
        exact = np.sqrt(np.sum(per ** 2, axis=1))
        assert np.all(f.bound.numpy() >= exact), v.path
    assert covered == 9  # 3 weights x (2 LSTM directions + GRU)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
