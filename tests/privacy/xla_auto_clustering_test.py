"""A private step refuses to run under XLA auto-clustering (session 23 review).

Auto-clustering (``tf.config.optimizer.set_jit("autoclustering")``, or ``TF_XLA_FLAGS``'
``--tf_xla_auto_jit``) compiles clusters of the private step with XLA for each shape it
meets, without ``jit_compile``: tf_dp could not see it, so it neither padded batches to one
shape nor reported ``XLA_BATCH_SHAPES``. Through ``train_on_batch``, one example moved the
clipped sum by 28.6 C (a custom RNN cell) and 36.3 C (LSTM) past crafted examples whose
gradients are mostly rounding. ``model.compile(jit_compile=True)`` is the supported route.
TensorFlow reads TF_XLA_FLAGS once per process, so a value set at the process's start is
refused too (checked in a fresh process).
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.core import private_step


def _model():
    keras.utils.set_random_seed(1)
    model = tf_dp.keras.make_private(keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    return model


def _custom_loop_step(model):
    """A traced custom loop step over ``tf_dp.core.clipped_sum`` and ``apply_private``."""
    opt = model.optimizer
    loss_fn = tf_dp.core.build_per_example_loss("mse")

    @tf.function
    def loop_step(x, y):
        out = tf_dp.core.clipped_sum(model, x, y, None, loss_fn, 1.0)
        opt.apply_private(out.grads, model.trainable_variables, 8.0)

    return loop_step


def _batch(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32)


def test_auto_clustering_set_in_the_process_is_refused(monkeypatch):
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    model = _model()
    tf.config.optimizer.set_jit("autoclustering")
    try:
        with pytest.raises(ValueError, match="auto-clustering"):
            model.train_on_batch(*_batch())
        assert int(model.optimizer.iterations) == 0 and model.accountant.steps == 0
    finally:
        tf.config.optimizer.set_jit(False)
    model = _model()
    model.train_on_batch(*_batch())  # off again: the step runs
    assert model.accountant.steps == 1


@pytest.mark.parametrize("flags, refused", [
    ("--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit", True),
    ("--tf_xla_auto_jit=1", True),
    ("--tf_xla_auto_jit=0", False),
    # Session 24 audit: with it, set_jit called after the step was traced reached it on
    # the CPU (12.3 C in a custom loop, 20.6 C over train_step).
    ("--tf_xla_cpu_global_jit", True),
    ("--tf_xla_cpu_global_jit=false", False),
    ("--tf_xla_min_cluster_size=1", False),
])
def test_auto_jit_in_tf_xla_flags_is_refused(flags, refused):
    out = _train_on_batch_in_a_fresh_process(flags, "TF_XLA_FLAGS")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("REFUSED True 0" if refused else "RAN 1") in out.stdout, out.stdout + out.stderr[-2000:]


def _train_on_batch_in_a_fresh_process(tf_xla_flags, word, prelude=""):
    """One train_on_batch in a new process started with TF_XLA_FLAGS=``tf_xla_flags`` (None:
    unset), after the code ``prelude``: its output says RAN <steps>, or REFUSED <whether the
    error names ``word``> <steps>."""
    code = (prelude + "import numpy as np, keras, tf_dp\n"
            "m = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)), "
            "keras.layers.Dense(2)]))\n"
            "m.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), "
            "loss='mse')\n"
            "try:\n"
            "    m.train_on_batch(np.zeros((8, 4), 'float32'), np.zeros((8, 2), 'float32'))\n"
            "    print('RAN', m.accountant.steps)\n"
            "except ValueError as e:\n"
            f"    print('REFUSED', {word!r} in str(e), m.accountant.steps)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TF_XLA_FLAGS"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if tf_xla_flags is not None:
        env["TF_XLA_FLAGS"] = tf_xla_flags
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_flag_parser(tmp_path):
    parse = private_step._auto_clustering_flags
    assert parse("--tf_xla_auto_jit=2 --foo") == "--tf_xla_auto_jit=2"
    assert parse("--tf_xla_auto_jit=fusible") == "--tf_xla_auto_jit=fusible"
    assert parse("--tf_xla_auto_jit=-1") == ""
    assert parse(None) == "" and parse("  ") == ""
    assert parse("--tf_xla_cpu_global_jit") == "--tf_xla_cpu_global_jit"
    # Session 24 audit: a value that is not flags is a flags file to XLA (2.89 C from one
    # holding --tf_xla_auto_jit=2); its flags count, and one tf_dp cannot read is refused.
    flags = tmp_path / "xla.flags"
    flags.write_text("--tf_xla_min_cluster_size=1\n--tf_xla_auto_jit=2\n")
    assert "--tf_xla_auto_jit=2 in the flags file" in parse(str(flags))
    flags.write_text("--tf_xla_min_cluster_size=1\n")
    assert parse(str(flags)) == ""
    assert "cannot read" in parse(str(tmp_path / "missing.flags"))


def test_a_flags_file_is_read_in_a_fresh_process(tmp_path):
    flags = tmp_path / "xla.flags"
    flags.write_text("--tf_xla_auto_jit=2 --tf_xla_min_cluster_size=1")
    out = _train_on_batch_in_a_fresh_process(str(flags), "TF_XLA_FLAGS")
    assert "REFUSED True 0" in out.stdout, out.stdout + out.stderr[-2000:]


def test_flags_unset_before_tf_dp_is_imported_are_read_from_tensorflow():
    # Session 24 review: TF_XLA_FLAGS set in the process, read by TensorFlow, then unset
    # before tf_dp's import: clean at every moment tf_dp read the environment (2.89 C
    # through train_on_batch). TensorFlow's parsed flags are read instead.
    prelude = ("import os\n"
               "os.environ['TF_XLA_FLAGS'] = '--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit'\n"
               "import tensorflow as tf\n"
               "tf.function(lambda: tf.constant(1.0) + 1.0)()\n"
               "del os.environ['TF_XLA_FLAGS']\n")
    out = _train_on_batch_in_a_fresh_process(None, "parsed", prelude)
    assert "REFUSED True 0" in out.stdout, out.stdout + out.stderr[-2000:]


_SET_JIT = {"tf.config": lambda: tf.config.optimizer.set_jit,
            "compat.v1": lambda: tf.compat.v1.config.optimizer.set_jit,
            "compat.v2": lambda: tf.compat.v2.config.optimizer.set_jit}


@pytest.mark.parametrize("route", sorted(_SET_JIT))
def test_auto_clustering_on_and_off_again_between_two_reads_voids_the_steps(monkeypatch,
                                                                             route):
    # Session 24 review: set_jit on for three steps of a custom loop and off before the
    # report left no caveat (7.31 C with TensorFlow's global jit flag). tf_dp records when
    # it was on; steps read after that carry the caveat, and a later read of steps run with
    # it off does not. Session 25 audit: the tf.compat aliases of set_jit are separate
    # functions, which tf_dp's wrapper of tf.config.optimizer.set_jit missed (no caveat);
    # tf_dp now records it where every route stores it, TensorFlow's eager context.
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    model = _model()
    loop_step = _custom_loop_step(model)
    x, y = _batch()
    loop_step(x, y)
    assert model.privacy_report()["guarantee_holds"]
    set_jit = _SET_JIT[route]()
    set_jit("autoclustering")
    try:
        loop_step(x, y)
    finally:
        set_jit(False)
    report = model.privacy_report()
    assert report["steps"] == 2 and not report["guarantee_holds"]
    assert any(c.startswith("XLA_AUTO_CLUSTERING") for c in report["caveats"])
    fresh = _model()  # a model whose steps all ran with it off
    fresh.train_on_batch(x, y)
    assert fresh.privacy_report()["guarantee_holds"]


def test_auto_clustering_turned_on_after_the_trace(monkeypatch):
    # Session 24 audit: the check ran only while the step was traced, and set_jit called
    # after it still reached the traced step. Keras' train function now checks at every
    # call, and a budget reading steps while it is on voids the report.
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    model = _model()
    model.train_on_batch(*_batch())
    loop_model = _model()
    loop_step = _custom_loop_step(loop_model)
    x, y = _batch()
    loop_step(x, y)  # traced and run without auto-clustering
    assert loop_model.privacy_report()["guarantee_holds"]
    tf.config.optimizer.set_jit("autoclustering")
    try:
        with pytest.raises(ValueError, match="auto-clustering"):
            model.train_on_batch(*_batch())
        assert model.accountant.steps == 1 and int(model.optimizer.iterations) == 1
        loop_step(x, y)  # the custom loop's traced step runs: its steps are voided
        report = loop_model.privacy_report()
    finally:
        tf.config.optimizer.set_jit(False)
    assert report["steps"] == 2 and not report["guarantee_holds"]
    assert any(c.startswith("XLA_AUTO_CLUSTERING") for c in report["caveats"])


def test_a_private_step_inside_a_jit_scope_is_refused():
    # Session 25 audit: tf.xla.experimental.jit_scope() marks the ops made in it for XLA,
    # and TensorFlow compiled the clipped sums' norms, products and sums in 19 clusters on
    # this CPU, with no flag: no refusal, no caveat. Refused while tracing, before any step.
    model = _model()
    x, y = _batch()
    model.train_on_batch(x, y)
    opt = model.optimizer
    loss_fn = tf_dp.core.build_per_example_loss("mse")

    @tf.function
    def sums_in_scope(a, b):
        with tf.xla.experimental.jit_scope():
            return tf_dp.core.clipped_sum(model, a, b, None, loss_fn, 1.0).grads

    @tf.function
    def update_in_scope(a, b):
        grads = tf_dp.core.clipped_sum(model, a, b, None, loss_fn, 1.0).grads
        with tf.xla.experimental.jit_scope():
            opt.apply_private(grads, model.trainable_variables, 8.0)

    @tf.function
    def callable_scope(a, b):  # session 25 review: compile_ops as a callable passed
        with tf.xla.experimental.jit_scope(compile_ops=lambda node_def: True):
            return tf_dp.core.clipped_sum(model, a, b, None, loss_fn, 1.0).grads

    @tf.function
    def train_step_in_scope(a, b):
        with tf.xla.experimental.jit_scope():
            return model.train_step((a, b))

    for fn, where in ((sums_in_scope, "clipped_sum"), (update_in_scope, "apply_private"),
                      (callable_scope, "clipped_sum"),
                      (train_step_in_scope, "clipped_sum")):
        with pytest.raises(ValueError, match=f"{where} is traced inside "
                                             r"tf.xla.experimental.jit_scope\(\)"):
            fn(x, y)
    assert model.accountant.steps == 1 and int(opt.iterations) == 1

    @tf.function
    def outside(a, b):  # the scope closed before the step: runs
        with tf.xla.experimental.jit_scope():
            a = a * 1.0
        grads = tf_dp.core.clipped_sum(model, a, b, None, loss_fn, 1.0).grads
        opt.apply_private(grads, model.trainable_variables, 8.0)

    outside(x, y)
    assert model.privacy_report()["steps"] == 2


class _XlaInside(keras.layers.Layer):
    """A Dense whose call enters XLA on its own: a jit_scope, or a jit-compiled function."""

    def __init__(self, mode, **kwargs):
        super().__init__(**kwargs)
        self.mode, self.inner = mode, keras.layers.Dense(3, activation="tanh")

    def build(self, shape):
        self.inner.build(shape)

    def call(self, x):
        if self.mode == "jit_scope":
            with tf.xla.experimental.jit_scope():
                return self.inner(x)
        if self.mode == "jit_compile":
            return tf.function(lambda t: self.inner(t), jit_compile=True)(x)
        return self.inner(x)


def _xla_loss(y_true, y_pred):  # a loss entering XLA on its own
    return tf.function(lambda a, b: tf.reduce_mean(tf.square(a - b), -1),
                       jit_compile=True)(y_true, y_pred)


@pytest.mark.parametrize("mode,strategy", [("jit_scope", "auto"), ("jit_compile", "auto"),
                                           ("jit_scope", "vectorized"), ("loss", "auto")])
def test_xla_entered_inside_the_model_or_the_loss_is_refused(mode, strategy):
    # Session 26 audit: the jit_scope check at the top of clipped_sum does not see a scope
    # (or a jit-compiled function) entered inside a layer's call: 9 steps ran with
    # "Compiled cluster using XLA!" logged and the report said the guarantee holds, while
    # XLA's tanh rounded 16 of 16 rows differently at 16 and 32 rows. Refused while the step
    # is traced, before any step; the same model without it trains.
    def model_for(layer_mode):
        keras.utils.set_random_seed(1)
        inp = keras.Input((4,))
        model = tf_dp.keras.make_private(
            keras.Model(inp, keras.layers.Dense(2)(_XlaInside(layer_mode)(inp))))
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                            norm_strategy=strategy),
                      loss=_xla_loss if layer_mode == "loss" else "mse")
        return model

    x, y = _batch()
    model = model_for(mode)
    with pytest.raises(ValueError, match="compile ops with XLA on its own"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.accountant.steps == 0 and int(model.optimizer.iterations) == 0
    plain = model_for("plain")
    plain.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert plain.accountant.steps > 0


_MODULE = """
module @jit_f attributes {jax.uses_shape_polymorphism = true} {
  func.func public @main(%arg0: tensor<?x4xf32>) -> tensor<?x4xf32> {
    %0 = stablehlo.tanh %arg0 : tensor<?x4xf32>
    return %0 : tensor<?x4xf32>
  }
}
"""


class _XlaOnlyOp(keras.layers.Layer):
    """tanh as jax2tf writes it: an XlaCallModule op, which TensorFlow compiles with XLA at
    run time for each input shape, without any XLA marker on the op or a function."""

    def call(self, x):
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops  # noqa: PLC0415

        (out,) = gen_xla_ops.xla_call_module(
            args=[x], version=9, module=_MODULE, Sout=[tf.TensorShape([None, 4])],
            Tout=[tf.float32], dim_args_spec=[], platforms=["CPU"], function_list=[],
            has_token_input_output=False, disabled_checks=[])
        out.set_shape(x.shape)
        return out


class _PythonInside(keras.layers.Layer):
    """An identity whose training pass runs Python code (tf.numpy_function)."""

    def call(self, x, training=False):
        if training:
            done = tf.numpy_function(lambda n: np.int32(0), [tf.shape(x)[0]], tf.int32,
                                     stateful=True)
            with tf.control_dependencies([done]):
                x = tf.identity(x)
        return x


def test_xla_only_ops_are_refused_and_python_code_voids_the_report():
    # Session 26 review: an XlaCallModule op (jax2tf's) in a layer is compiled by XLA per
    # input shape and carries no XLA marker; Python code in the step (tf.py_function,
    # numpy_function) runs anything, XLA included (16 of 16 examples' norms differed at
    # 16 and 32 rows), and the report said the guarantee holds.
    x, y = _batch()

    def model_with(layer):
        keras.utils.set_random_seed(1)
        inp = keras.Input((4,))
        model = tf_dp.keras.make_private(
            keras.Model(inp, keras.layers.Dense(2)(layer(inp))))
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss="mse")
        return model

    model = model_with(_XlaOnlyOp())
    with pytest.raises(ValueError, match="XLA-only op"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.accountant.steps == 0
    model = model_with(_PythonInside())
    with pytest.warns(UserWarning, match="OPAQUE_PYTHON"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    report = model.privacy_report()
    assert report["steps"] > 0 and not report["guarantee_holds"]
    assert any(c.startswith("OPAQUE_PYTHON") for c in report["caveats"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
