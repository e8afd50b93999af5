"""A user's ghost rule through the public decorator: docs/extending.md's worked example,
run as it stands in the doc, against brute force; and the ways a rule can fail, each of
which must leave the private step exact (the layer's weights take the vectorized fallback).
"""

import logging
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: `tests` importable like under pytest / Bazel
    sys.path.insert(0, _ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tests import _reference as ref  # noqa: E402
from tf_dp.core import build_per_example_loss, clipped_sum  # noqa: E402
from tf_dp.core.ghost import rows  # noqa: E402

_DOC = os.path.join(_ROOT, "docs", "extending.md")
_LOSS = build_per_example_loss("mse")


def _doc_blocks():
    """{name: code} of the ```python blocks marked ``<!-- ghost-example: name -->``."""
    with open(_DOC, encoding="utf-8") as f:
        text = f.read()
    blocks = dict(re.findall(r"<!-- ghost-example: (\w+) -->\s*```python\n(.*?)```", text,
                             flags=re.S))
    assert set(blocks) == {"layer", "rule"}, sorted(blocks)
    return blocks


def _register():
    """The public decorator (``tf_dp.core``'s until the top-level name exists)."""
    return getattr(tf_dp, "register_ghost_rule", tf_dp.core.register_ghost_rule)


def _model(layer_cls, float64=True, **kwargs):
    keras.utils.set_random_seed(0)
    saved = keras.config.floatx(), keras.config.dtype_policy()
    if float64:
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
    try:
        return keras.Sequential([keras.Input((3, 4)), layer_cls(5, **kwargs), keras.layers.Flatten(),
                                 keras.layers.Dense(2)])
    finally:
        keras.config.set_floatx(saved[0])
        keras.config.set_dtype_policy(saved[1])


def _data(dtype="float64"):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 3, 4)).astype(dtype)
    y = rng.normal(size=(4, 2)).astype(dtype)
    return x, y, np.array([1.0, 0.5, 2.0, 1.0], dtype)


def _check_exact(model, strategy, rtol=1e-9):
    x, y, sw = _data(model.dtype)
    per = ref.per_example_gradients(model, _LOSS, x, y, sw)
    norms = ref.per_example_norms(per)
    clip = float(np.float32(np.median(norms)))  # some examples clipped, some not
    w = ref.clip_weights(norms, clip)
    res = clipped_sum(model, x, y, sw, _LOSS, clip, norm_strategy=strategy)
    np.testing.assert_allclose(res.norms.numpy(), norms, rtol=rtol)
    scale = max(float(np.max(np.abs(g))) for g in per)
    for got, g, v in zip(res.grads, per, model.trainable_variables):
        np.testing.assert_allclose(got.numpy(), np.tensordot(w, g, axes=1), rtol=rtol,
                                   atol=rtol * scale, err_msg=v.path)


def _ghost_refuses(model):
    x, y, sw = _data(model.dtype)
    with pytest.raises(ValueError, match="no ghost-norm"):
        clipped_sum(model, x, y, sw, _LOSS, 1.0, norm_strategy="ghost")


def test_doc_example_rule_is_exact_and_needed_for_ghost_norms():
    blocks = _doc_blocks()
    namespace = {}
    exec(compile(blocks["layer"], _DOC + ":layer", "exec"), namespace)
    scaled_dense = namespace["ScaledDense"]
    model = _model(scaled_dense, scale=1.5)
    # Before registration: the fallback is exact, ghost norms are refused.
    _ghost_refuses(model)
    _check_exact(model, "auto")
    exec(compile(blocks["rule"], _DOC + ":rule", "exec"), namespace)
    assert tf_dp.core.ghost.rule_for(model.layers[0]) is namespace["scaled_dense_rule"]
    _check_exact(model, "ghost")
    _check_exact(model, "auto")
    # float32 as well (dz arrives in float32 whatever the compute dtype).
    _check_exact(_model(scaled_dense, float64=False, scale=1.5), "ghost", rtol=2e-5)


class _Scaled(keras.layers.Layer):
    """Same computation as the doc's ScaledDense; each test subclasses it, so that its
    registrations (global, permanent) apply to that test's class only."""

    def __init__(self, units, scale=1.5, **kwargs):
        super().__init__(**kwargs)
        self.units, self.scale = units, scale

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units),
                                      initializer="glorot_uniform", name="kernel")

    def call(self, x):
        return self.scale * tf.tensordot(x, self.kernel, axes=1)


def _fresh():
    return type("Scaled", (_Scaled,), {})


def test_rule_that_raises_falls_back_with_a_warning(caplog):
    cls = _fresh()

    @_register()(cls)
    def broken(layer, ctx, inputs):
        ctx.read(layer.kernel)
        raise RuntimeError("this rule is broken")

    model = _model(cls)
    with caplog.at_level(logging.WARNING, logger="tf_dp"):
        _check_exact(model, "auto")
    messages = [r.getMessage() for r in caplog.records if r.name == "tf_dp"]
    assert any(model.layers[0].name in m and "this rule is broken" in m for m in messages), \
        messages
    _ghost_refuses(model)


def test_weight_read_without_ctx_read_takes_the_fallback():
    cls = _fresh()

    @_register()(cls)
    def reads_directly(layer, ctx, inputs):
        x = ctx.batch_input(layer, inputs)
        z = layer.scale * tf.tensordot(x, layer.kernel, axes=1)  # not through ctx.read
        ctx.outer(layer.kernel, z, lambda: layer.scale * rows(x))
        return z

    model = _model(cls)
    _check_exact(model, "auto")
    _ghost_refuses(model)  # the term is not trusted: the kernel got a gradient of its own


def test_weight_read_but_described_by_no_term_takes_the_fallback():
    cls = _fresh()

    @_register()(cls)
    def records_nothing(layer, ctx, inputs):
        x = ctx.batch_input(layer, inputs)
        return layer.scale * tf.tensordot(x, ctx.read(layer.kernel, x.dtype), axes=1)

    model = _model(cls)
    _check_exact(model, "auto")
    _ghost_refuses(model)


def test_declined_configuration_runs_the_layers_own_call():
    cls = _fresh()
    calls = []

    @_register()(cls)
    def positive_scale_only(layer, ctx, inputs):
        calls.append(layer.scale)
        if layer.scale < 0:
            return NotImplemented
        x = ctx.batch_input(layer, inputs)
        z = layer.scale * tf.tensordot(x, ctx.read(layer.kernel, x.dtype), axes=1)
        ctx.outer(layer.kernel, z, lambda: layer.scale * rows(x))
        return z

    _check_exact(_model(cls, scale=2.0), "ghost")
    declined = _model(cls, scale=-2.0)
    _check_exact(declined, "auto")
    _ghost_refuses(declined)
    assert -2.0 in calls


def test_ghost_call_method_is_a_rule():
    class WithMethod(_Scaled):
        def ghost_call(self, ctx, inputs):
            x = ctx.batch_input(self, inputs)
            z = self.scale * tf.tensordot(x, ctx.read(self.kernel, x.dtype), axes=1)
            ctx.outer(self.kernel, z, lambda: self.scale * rows(x))
            return z

    _check_exact(_model(WithMethod), "ghost")


def test_register_rejects_non_classes():
    with pytest.raises(TypeError):
        _register()()
    with pytest.raises(TypeError):
        _register()("Dense")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
