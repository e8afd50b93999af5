"""jit_compile=True (XLA) for the private step: compiled where XLA can, said once and run
without where it would abort the process (the micro-batch loop), and the noise still there."""

import math
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp

pytestmark = pytest.mark.filterwarnings("ignore:tf_dp. training on a dataset of fixed")


def _cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3),
                             keras.layers.Flatten(), keras.layers.Dense(10)])


def _data(n=96):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8, 8, 1)).astype("float32"), rng.integers(0, 10, n)


def _compiled(model, **optimizer_args):
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        **optimizer_args),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    return model


@pytest.mark.parametrize("strategy", ["auto", pytest.param("jl", marks=pytest.mark.slow)])
def test_the_private_step_compiles_with_xla(strategy):
    x, y = _data()
    extra = {"norm_strategy": tf_dp.JL(3)} if strategy == "jl" else {}
    model = _compiled(tf_dp.keras.make_private(_cnn()), **extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*jit_compile")
        warnings.filterwarnings("ignore", message=".*JL norms cost")
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert model.jit_compile is True
    assert np.isfinite(history.history["loss"][-1])
    assert model.accountant.steps == 3


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0")
def test_under_xla_a_non_finite_example_adds_nothing():
    # XLA drops the CheckNumerics assertion that stops a step with a NaN or infinite
    # per-example gradient: one example with an infinite loss gradient made every weight NaN,
    # released whenever it was sampled (session 13 audit). Under XLA such an example gets
    # clip factor 0: the update is that of the batch without it (sigma = 0 to compare).
    def run(weights):
        keras.utils.set_random_seed(1)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((3,)), keras.layers.Dense(2, activation="tanh"), keras.layers.Dense(1)]))
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0,
                                            learning_rate=0.5), loss="mse", jit_compile=True)
        x = np.random.default_rng(2).normal(size=(4, 3)).astype("float32")
        y = np.random.default_rng(3).normal(size=(4, 1)).astype("float32")
        x[0], y[0] = 0.0, 3.4e38  # d loss / d output = -inf
        model.train_on_batch(x, y, sample_weight=weights)
        return model.get_weights()

    with_poison = run(np.ones(4, np.float32))
    without = run(np.array([0.0, 1.0, 1.0, 1.0], np.float32))
    for a, b in zip(with_poison, without):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_an_optimizer_with_slots_compiles_with_xla():
    """DPAdam's moments were created inside the traced step, under its conditionals, where
    XLA cannot lift them ("failed to lift variable creations"): non-private Adam compiled,
    DPAdam did not. The private step now builds the optimizer out of the trace."""
    x, y = _data()
    model = tf_dp.keras.make_private(_cnn())
    model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*jit_compile")
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert model.accountant.steps == 3
    assert all(np.any(keras.ops.convert_to_numpy(m) != 0)
               for m in model.optimizer._momentums)


@pytest.mark.parametrize("memory", [
    {"gradient_accumulation_steps": 2},
    pytest.param({"max_physical_batch_size": 16}, marks=pytest.mark.slow)])
def test_the_micro_batch_loop_runs_without_xla_and_says_so_once(memory):
    # XLA aborts the whole process on this loop (a CHECK failure, no exception): without the
    # guard this test does not fail, it kills the test process.
    x, y = _data()
    optimizer_args = {k: v for k, v in memory.items() if k == "gradient_accumulation_steps"}
    fit_args = {k: v for k, v in memory.items() if k == "max_physical_batch_size"}
    model = _compiled(tf_dp.keras.make_private(_cnn()), **optimizer_args)
    with pytest.warns(UserWarning, match="jit_compile=True is not used"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, **fit_args)
    assert model.jit_compile is False
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*jit_compile")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, **fit_args)  # said once
    k = memory.get("gradient_accumulation_steps", 1)
    assert model.accountant.steps == 2 * round(len(x) / (32 * k))  # two fits of N/(B k) steps


def _zero_loss(y_true, y_pred):
    return 0.0 * tf.reduce_sum(y_pred, axis=-1)


def test_xla_keeps_the_noise_at_sigma_c_over_the_batch():
    """Zero loss: the update is the noise alone, N(0, (σC / B)²) per coordinate, also when
    XLA compiles the step (a constant-folded or dropped random op would show here)."""
    clip, sigma, batch = 1.0, 2.0, 8
    rng = np.random.default_rng(2)
    x = rng.normal(size=(batch, 150)).astype("float32")
    y = np.zeros((batch, 140), np.float32)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((150,)),
                                                       keras.layers.Dense(140)]))
    model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
    model.compile(optimizer=tf_dp.DPSGD(clip, sigma, learning_rate=1.0), loss=_zero_loss,
                  jit_compile=True)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(ds, epochs=1, verbose=0, dataset_size=batch)
    assert model.jit_compile is True
    update = np.concatenate([w.ravel() for w in model.get_weights()])
    std, n = sigma * clip / batch, update.size
    # Unseeded: 6 standard errors, 2e-9 each (at 5, the two checks failed w.p. 1.1e-6).
    assert abs(update.std() / std - 1) < 6 / math.sqrt(2 * n), update.std() / std
    assert abs(update.mean()) < 6 * std / math.sqrt(n)


def test_jl_on_an_embedding_compiles_with_whole_table_directions():
    """How many rows a batch looks up depends on the data, and XLA's random ops need a static
    shape: JL's directions on the looked-up rows only (jl.draw_rows) made a compiled step
    fail to run. Under XLA the whole table's directions are drawn (the same law on those
    rows). Pinned against brute force: the JL estimate is sqrt(mean_j <g_i, v_j>^2) with v_j
    the table's whole directions and g_i each example's exact gradient; and fit trains."""
    from tf_dp.core import clipped_sum, jl  # noqa: PLC0415

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 12, (6, 4)).astype(np.int32)
    y = rng.normal(size=(6, 3)).astype(np.float32)
    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(12, 5),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(3, trainable=False)])
    table = model.layers[0].embeddings
    seed, r = tf.constant([7, -3], tf.int64), 3

    def loss(y_true, y_pred, sw):
        per = tf.reduce_sum(tf.square(y_pred - y_true), axis=-1)
        return per if sw is None else per * sw

    @tf.function(jit_compile=True)
    def estimates(x, t):
        return clipped_sum(model, x, t, tf.ones([6]), loss, 1.0, variables=[table],
                           norm_strategy="jl", num_projections=r, seed=seed).norms

    got = estimates(tf.constant(ids), tf.constant(y)).numpy()
    directions = jl.draw(table, 0, r, seed).numpy().astype(np.float64)
    want = []
    for i in range(6):
        with tf.GradientTape() as tape:
            per = loss(y[i:i + 1], model(ids[i:i + 1]), None)
        g = tf.convert_to_tensor(tape.gradient(per, table)).numpy().astype(np.float64)
        want.append(np.sqrt(np.mean([np.sum(g * d) ** 2 for d in directions])))
    np.testing.assert_allclose(got, want, rtol=1e-5)

    private = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((4,), dtype="int32"), keras.layers.Embedding(12, 5),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]))
    private.compile(optimizer=tf_dp.DPAdamJL(l2_norm_clip=1.0, noise_multiplier=1.0,
                                             num_projections=2),
                    loss="sparse_categorical_crossentropy", jit_compile=True)
    labels = rng.integers(0, 3, 48)
    ids = rng.integers(0, 12, (48, 4)).astype(np.int32)
    history = private.fit(ids, labels, batch_size=8, epochs=1, verbose=0)
    assert private.jit_compile is True and np.isfinite(history.history["loss"][-1])
    assert private.accountant.steps == 6


def test_a_dense_over_a_sequence_compiles_and_its_ill_conditioned_norms_hold():
    """A Dense over T >= 2 positions takes Gram norms, and its ill-conditioned examples get
    float64 norms in a loop whose sizes depended on how many there are: under XLA the step
    did not run (nor did the Gram sums' chunk loop with a batch smaller than a chunk, as
    fit's Poisson batches are). Now: fit trains, and a victim whose two steps cancel keeps
    its norm (0.9 C) and an ordinary example moves the sum by C, as without XLA."""
    from tf_dp.core import clipped_sum  # noqa: PLC0415

    width = 64
    layer_model = keras.Sequential([keras.Input((2, width)),
                                    keras.layers.Dense(width, use_bias=False)])

    def example(x0, x1, y0, y1):
        x, y = np.zeros((1, 2, width), np.float32), np.zeros((1, 2, width), np.float32)
        x[0, 0, 0], x[0, 1, 0], y[0, 0, 0], y[0, 1, 0] = x0, x1, y0, y1
        return x, y

    def loss(y, pred, sw):
        per = tf.reduce_sum(tf.reshape(pred * y, [tf.shape(y)[0], -1]), axis=-1)
        return per if sw is None else per * sw

    victim, attacker = example(1, 1, 1e4, -1e4 + 0.9), example(1, 0, -2.0, 0)
    results = {}
    for jit in (False, True):
        @tf.function(jit_compile=jit)
        def summed(x, y):
            out = clipped_sum(layer_model, x, y, tf.ones([tf.shape(x)[0]]), loss, 1.0,
                              norm_strategy="ghost")
            return out.grads[0], out.norms

        alone, norm_alone = summed(*victim)
        both, norms = summed(*(np.concatenate(p) for p in zip(victim, attacker)))
        # An empty batch compiles and adds nothing (an empty Poisson batch under fit made the
        # chunk loop's buffer empty, which XLA refuses even inside the branch fit skips).
        empty, empty_norms = summed(*(p[:0] for p in victim))
        assert empty_norms.shape == (0,) and not np.any(empty.numpy())
        results[jit] = (norm_alone.numpy(), norms.numpy(),
                        np.linalg.norm(both.numpy().astype(np.float64)
                                       - alone.numpy().astype(np.float64)))
    for jit, (norm_alone, norms, moved) in results.items():
        np.testing.assert_allclose(norm_alone, [0.9], rtol=1e-3)
        np.testing.assert_allclose(norms[:1], norm_alone, rtol=1e-9)
        assert moved <= 1.0 + 1e-6, (jit, moved)
    np.testing.assert_allclose(results[True][1], results[False][1], rtol=1e-6)

    rng = np.random.default_rng(4)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((2, width)), keras.layers.Dense(width), keras.layers.Flatten(),
        keras.layers.Dense(3)]))
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="sparse_categorical_crossentropy", jit_compile=True)
    history = model.fit(rng.normal(size=(16, 2, width)).astype(np.float32),
                        rng.integers(0, 3, 16), batch_size=4, epochs=1, verbose=0)
    assert model.jit_compile is True and np.isfinite(history.history["loss"][-1])


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0")
def test_class_weight_under_xla_weights_the_padded_batches():
    """Under XLA fit pads its Poisson batches (weight 0 on padding rows), and Keras refuses
    class_weight next to sample weights: the class weights become the sample weights. With
    sigma = 0, weights of 0 for every class leave the model as it was; weights of 1 move
    it."""
    x, y = _data(64)
    moved = {}
    for weight in (0.0, 1.0):
        keras.utils.set_random_seed(2)
        model = tf_dp.keras.make_private(_cnn())
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0,
                                            learning_rate=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
        before = model.get_weights()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  class_weight={c: weight for c in range(10)})
        assert model.jit_compile is True
        moved[weight] = sum(float(np.sum((a - b) ** 2))
                            for a, b in zip(model.get_weights(), before))
    assert moved[0.0] == 0.0 and moved[1.0] > 1e-6, moved



@pytest.mark.parametrize("strategy", ["auto", "jl", "vmap"])
def test_poisson_batches_of_zero_and_one_example_compile(strategy):
    """fit's Poisson batches have a size XLA sees only at run time, and it compiles the step
    for each one. At q = 1/16 most batches hold 0, 1 or 2 examples: the convolution's
    per-example gradients (chunk slices whose size XLA inferred from a loop index) failed
    to compile for B = 1 under exact and JL norms, and the vectorized fallback for B = 0;
    training stopped at the first such batch (session 19's probe)."""
    x, y = _data(16)
    extra = {"jl": {"norm_strategy": tf_dp.JL(2)}, "vmap": {"norm_strategy": "vmap"},
             "auto": {}}[strategy]
    model = _compiled(tf_dp.keras.make_private(_cnn()), **extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*JL norms cost")
        history = model.fit(x, y, batch_size=1, epochs=2, verbose=0)
    assert model.jit_compile is True
    assert model.accountant.steps == 32
    assert np.all(np.isfinite(history.history["loss"]))


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0")
@pytest.mark.filterwarnings("ignore:.*XLA_BATCH_SHAPES")
@pytest.mark.parametrize("strategy", ["auto", "vmap"])
def test_under_xla_a_small_batch_gets_exactly_its_own_update(strategy):
    """A batch of fewer than 16 rows runs padded with rows of weight 0 (private_step.
    MIN_ROWS; under XLA it also spares the step a batch of 0 or 1 row, which several paths
    could not compile): they must add nothing. With sigma = 0 and plain SGD, B = 0 leaves
    the weights as they were and B = 1 or 2 moves them exactly as the same step without
    XLA (a padding row that counted, in the sum or in the divisor, would show). A traced
    custom loop under XLA: the report says the batch shapes followed the data."""
    rng = np.random.default_rng(5)
    x, y = _data(3)
    start = None
    results = {}
    for jit in (False, True):
        for n in (0, 1, 2):
            keras.utils.set_random_seed(3)
            model = tf_dp.keras.make_private(_cnn())
            if start is None:
                start = [w + rng.normal(size=w.shape).astype("float32") * 0.1
                         for w in model.get_weights()]
            model.set_weights(start)
            extra = {"norm_strategy": "vmap"} if strategy == "vmap" else {}
            model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=0.5, noise_multiplier=0.0,
                                                learning_rate=1.0, **extra),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=jit)
            model.check_before_training(x, y)

            @tf.function(jit_compile=jit, input_signature=[
                tf.TensorSpec([None, 8, 8, 1]), tf.TensorSpec([None], tf.int64)])
            def step(xb, yb):
                return model.train_step((xb, yb))

            step(tf.constant(x[:n]), tf.constant(y[:n], tf.int64))
            results[jit, n] = model.get_weights()
    for a, b in zip(results[True, 0], start):
        np.testing.assert_array_equal(a, b)
    for n in (1, 2):
        moved = sum(float(np.sum((a - b) ** 2)) for a, b in zip(results[False, n], start))
        assert moved > 1e-6  # the step did something to compare
        for a, b in zip(results[True, n], results[False, n]):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_conv_per_example_gradients_in_several_chunks_under_xla(monkeypatch):
    """The convolution's per-example kernel gradients under XLA, the batch read as chunks of
    equal size (padded, the padding cut off): against the same sums without XLA, for
    batches of 0 to 5 rows in chunks of 2 (the last one short)."""
    from tf_dp.core import clipped_sum  # noqa: PLC0415
    from tf_dp.core.ghost.rules import conv as conv_rule  # noqa: PLC0415

    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(3, 3),
                              keras.layers.Flatten()])
    # 2 examples per chunk: 36 output positions x 9 patch entries x 4 bytes each
    monkeypatch.setattr(conv_rule, "_CHUNK_BYTES", 2 * 36 * 9 * 4)

    def loss(y_true, y_pred, sw):
        per = tf.reduce_sum(y_pred * y_true, axis=-1)
        return per if sw is None else per * sw

    x = np.random.default_rng(6).normal(size=(5, 8, 8, 1)).astype("float32")
    t = np.random.default_rng(7).normal(size=(5, 108)).astype("float32")
    for strategy, extra in (("ghost", {}),
                            ("jl", {"num_projections": 2,
                                    "seed": tf.constant([4, 9], tf.int64)})):
        got = {}
        for jit in (False, True):
            @tf.function(jit_compile=jit, input_signature=[
                tf.TensorSpec([None, 8, 8, 1]), tf.TensorSpec([None, 108])])
            def summed(xb, yb):
                out = clipped_sum(model, xb, yb, tf.ones([tf.shape(xb)[0]]), loss, 0.7,
                                  norm_strategy=strategy, **extra)
                return out.grads, out.norms

            got[jit] = [summed(x[:n], t[:n]) for n in range(6)]
        for n in range(6):
            (g0, n0), (g1, n1) = got[False][n], got[True][n]
            assert n1.shape == (n,)
            np.testing.assert_allclose(n1, n0, rtol=1e-5)
            for a, b in zip(g1, g0):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
