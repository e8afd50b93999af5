"""StreamingPCA against numpy.linalg.eigh on stored gradients; ProjectedSGD; GradientSpectrum."""

import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.analysis import GradientSpectrum, ProjectedSGD, StreamingPCA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _eigh(g):
    """Eigenvalues (descending) and eigenvectors of M = GᵀG / T, from all stored rows."""
    values, vectors = np.linalg.eigh(g.T @ g / len(g))
    return values[::-1], vectors[:, ::-1]


def _projector(v):
    return v @ v.T


# ---------------------------------------------------------------------- StreamingPCA
def test_low_rank_stream_is_exact():
    rng = np.random.default_rng(0)
    d, rank, steps, ell = 40, 5, 300, 8  # 300 rows: the 16-row sketch shrinks many times
    g = rng.standard_normal((steps, rank)) @ rng.standard_normal((rank, d))
    pca = StreamingPCA(d, ell)
    for row in g:
        pca.update(row)
    values, vectors = _eigh(g)
    np.testing.assert_allclose(pca.eigenvalues(rank), values[:rank], rtol=1e-9)
    np.testing.assert_allclose(pca.eigenvalues()[rank:], 0.0, atol=1e-9 * values[0])
    assert pca.eigenvalue_error_bound <= 1e-9 * values[0]
    # The principal subspaces agree (eigenvectors up to sign, within distinct eigenvalues).
    np.testing.assert_allclose(_projector(pca.components(rank)), _projector(vectors[:, :rank]),
                               atol=1e-8)
    for i in range(rank):
        assert abs(abs(pca.components(rank)[:, i] @ vectors[:, i]) - 1) < 1e-8
    assert pca.num_vectors == steps
    np.testing.assert_allclose(pca.trace, np.trace(g.T @ g) / steps, rtol=1e-12)


def test_full_rank_stream_within_frequent_directions_bound():
    rng = np.random.default_rng(1)
    d, steps, ell = 60, 500, 12
    g = rng.standard_normal((steps, d)) * np.arange(1, d + 1) ** -0.7  # decaying spectrum
    pca = StreamingPCA(d, ell).update(g)  # one batch update
    values, _ = _eigh(g)
    bound = pca.eigenvalue_error_bound
    assert bound > 0  # the sketch did shrink
    mu = pca.eigenvalues()
    tol = 1e-10 * values[0]
    # 0 ⪯ GᵀG − BᵀB ⪯ Δ I  =>  μ_i ≤ λ_i ≤ μ_i + Δ/T.
    assert np.all(mu <= values[:ell] + tol)
    assert np.all(values[:ell] <= mu + bound + tol)
    # Δ ≤ ‖G − G_k‖_F² / (ℓ − k) for every k < ℓ (here per T: tail eigenvalues of M).
    for k in range(ell):
        assert bound <= values[k:].sum() / (ell - k) + tol
    # Top-k subspace captures nearly the best energy: ‖G − G V Vᵀ‖² ≤ ℓ/(ℓ−k) ‖G − G_k‖².
    for k in (1, 3, 6):
        v = pca.components(k)
        residual = np.sum((g - g @ v @ v.T) ** 2) / steps
        assert residual <= ell / (ell - k) * values[k:].sum() + tol
    np.testing.assert_allclose(pca.components().T @ pca.components(), np.eye(ell), atol=1e-10)


def test_row_by_row_and_batch_updates_agree():
    rng = np.random.default_rng(2)
    g = rng.standard_normal((50, 20))
    one = StreamingPCA(20, 4)
    for row in g:
        one.update(row)
    batch = StreamingPCA(20, 4).update(g[:7]).update(g[7:])
    np.testing.assert_allclose(one.eigenvalues(), batch.eigenvalues(), rtol=1e-10)
    assert one.eigenvalue_error_bound == pytest.approx(batch.eigenvalue_error_bound, rel=1e-10)


def test_memory_is_order_sketch_times_dim():
    rng = np.random.default_rng(3)
    d, ell, steps = 30, 4, 2000
    pca = StreamingPCA(d, ell)
    for start in range(0, steps, 100):
        pca.update(rng.standard_normal((100, d)))
    arrays = [v for v in vars(pca).values() if isinstance(v, np.ndarray)]
    assert arrays and all(a.size <= 2 * ell * d for a in arrays)  # never a T×d array
    assert pca.num_vectors == steps


def test_fewer_vectors_than_components():
    pca = StreamingPCA(6, 4).update(np.array([[3.0, 0, 0, 0, 0, 0], [0, 4.0, 0, 0, 0, 0]]))
    np.testing.assert_allclose(pca.eigenvalues(), [8.0, 4.5, 0.0, 0.0], atol=1e-12)
    v = pca.components()
    assert v.shape == (6, 4)
    np.testing.assert_allclose(v.T @ v, np.eye(4), atol=1e-12)
    np.testing.assert_allclose(pca.explained_variance_ratio(2), [8 / 12.5, 4.5 / 12.5])


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=0, sketch_size=4), "`dim` must be an integer >= 1, got 0"),
    (dict(dim=5, sketch_size=-1), "`sketch_size` must be an integer >= 1, got -1"),
    (dict(dim=5.0, sketch_size=2), "`dim` must be an integer"),
])
def test_streaming_pca_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StreamingPCA(**kwargs)


def test_streaming_pca_bad_updates():
    pca = StreamingPCA(3, 2)
    with pytest.raises(ValueError, match="no vectors yet"):
        pca.eigenvalues()
    with pytest.raises(ValueError, match=r"`vectors` must have shape \[3\] or \[n, 3\], got \[4\]"):
        pca.update(np.ones(4))
    with pytest.raises(ValueError, match="`vectors` must be finite"):
        pca.update(np.array([1.0, np.nan, 0.0]))
    pca.update(np.ones(3))
    with pytest.raises(ValueError, match="`k` must be an integer >= 1, got 0"):
        pca.components(0)


# ---------------------------------------------------------------------- ProjectedSGD
def _orthonormal(d, k, seed=0):
    return np.linalg.qr(np.random.default_rng(seed).standard_normal((d, k)))[0]


def test_projected_sgd_one_step_by_hand():
    u = _orthonormal(5, 2)
    w = keras.Variable(np.arange(3, dtype="float32"), name="w")
    b = keras.Variable(np.ones(2, dtype="float32"), name="b")
    g = np.array([0.3, -1.0, 2.0, 0.5, 0.1], dtype="float32")
    opt = ProjectedSGD(u, learning_rate=0.5)
    opt.apply([tf.constant(g[:3]), tf.constant(g[3:])], [w, b])
    expected = np.concatenate([np.arange(3), np.ones(2)]) - 0.5 * u @ (u.T @ g)
    np.testing.assert_allclose(np.concatenate([w.numpy(), b.numpy()]), expected, rtol=1e-5,
                               atol=1e-6)


def test_projected_sgd_orthogonal_gradient_gives_no_update_and_paths_select():
    u = _orthonormal(3, 1)
    orthogonal = np.linalg.svd(u.T)[2][1]  # ⟂ u
    w = keras.Variable(np.zeros(3, dtype="float32"), name="kernel")
    b = keras.Variable(np.zeros(2, dtype="float32"), name="bias")
    opt = ProjectedSGD(u, variable_paths=["kernel"], learning_rate=1.0)
    opt.apply([tf.constant(orthogonal, tf.float32), tf.constant([1.0, 2.0])], [w, b])
    np.testing.assert_allclose(w.numpy(), 0.0, atol=1e-6)  # projected away
    np.testing.assert_allclose(b.numpy(), [-1.0, -2.0])  # not chosen: plain SGD


def test_private_projected_update_lies_in_subspace():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    model = tf_dp.keras.DPSequential([keras.Input((5,)), keras.layers.Dense(2, name="d")])
    u = _orthonormal(12, 3)
    optimizer = tf_dp.make_private_optimizer(ProjectedSGD(u, learning_rate=0.1, momentum=0.5),
                                             l2_norm_clip=1.0, noise_multiplier=2.0)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    update = np.concatenate([v.numpy().ravel() for v in model.trainable_variables]) - before
    # Noised steps moved the weights (unseeded: the noise alone gives the update sd ~0.04 per
    # coordinate of span(U); below 1e-3 w.p. up to ~4e-6, below 2e-4 ~4e-8)...
    assert np.linalg.norm(update) > 2e-4
    np.testing.assert_allclose(update - u @ (u.T @ update), 0.0, atol=1e-5)  # ...inside span(U)
    assert np.isfinite(model.epsilon())
    config = optimizer.get_config()
    assert config["noise_multiplier"] == 2.0 and np.allclose(config["basis"], u, atol=1e-6)


def test_projected_sgd_config_round_trip():
    u = _orthonormal(4, 2)
    opt = ProjectedSGD(u, variable_paths=["a/kernel", "bias"], learning_rate=0.3, momentum=0.9)
    clone = ProjectedSGD.from_config(opt.get_config())
    np.testing.assert_allclose(clone.basis, u.astype("float32"))
    assert clone.variable_paths == ["a/kernel", "bias"]
    assert float(clone.learning_rate) == pytest.approx(0.3) and clone.momentum == 0.9
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, ProjectedSGD)


def test_projected_sgd_bad_arguments():
    with pytest.raises(ValueError, match=r"`basis` must be a d x k array .* got shape \[3\]"):
        ProjectedSGD(np.ones(3))
    with pytest.raises(ValueError, match="`basis` must have orthonormal columns"):
        ProjectedSGD(np.ones((3, 2)))
    with pytest.raises(ValueError, match="`variable_paths` must be a list"):
        ProjectedSGD(_orthonormal(3, 1), variable_paths="kernel")
    w = keras.Variable(np.zeros(4, dtype="float32"), name="kernel")
    with pytest.raises(ValueError, match="`basis` has 3 rows but the projected variables have 4"):
        ProjectedSGD(_orthonormal(3, 1)).apply([tf.zeros(4)], [w])
    with pytest.raises(ValueError, match="`variable_paths` entry 'nope' matches 0"):
        ProjectedSGD(_orthonormal(4, 1), variable_paths=["nope"]).apply([tf.zeros(4)], [w])


# ---------------------------------------------------------------------- GradientSpectrum
def _tiny(n=48):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4, 4, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int64")
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.DPSequential([
        keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3, name="conv"),
        keras.layers.Flatten(), keras.layers.Dense(2, name="logits")])
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.5,
                                        learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y


def test_gradient_spectrum_streams_the_batch_gradient(caplog):
    model, x, y = _tiny()
    spectrum = GradientSpectrum(x[:16], y[:16], sketch_size=4, variables=["conv"],
                                every_n_steps=2, k_logged=(1, 2))
    with caplog.at_level(logging.WARNING, logger="tf_dp"):
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[spectrum])
    assert sum("NOT covered" in r.getMessage() for r in caplog.records) == 1
    assert any(c.startswith("ANALYSIS_LOGS") and "GradientSpectrum" in c
               for c in model.privacy_caveats)  # named in the report (session 22 audit)
    steps = model.optimizer.iterations.numpy()
    assert spectrum.pca.num_vectors == steps // 2 and spectrum.pca.dim == 2 * 9 + 2
    assert spectrum.variable_paths == [v.path for v in model.get_layer("conv").trainable_variables]
    share = history.history["gradient_spectrum_top2"]
    assert len(share) == 2 and 0 < share[-1] <= 1 + 1e-9
    assert spectrum.seconds > 0
    # The gradient it streams is the mean-loss gradient on the analysis batch.
    conv = model.get_layer("conv").trainable_variables
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y[:16], model(x[:16], training=False))
    expected = np.concatenate([g.numpy().ravel() for g in tape.gradient(loss, conv)])
    np.testing.assert_allclose(spectrum.gradient(), expected, rtol=1e-4, atol=1e-6)


def test_gradient_spectrum_bad_arguments():
    x, y = np.zeros((4, 2)), np.zeros(4)
    with pytest.raises(ValueError, match="`every_n_steps` must be an integer >= 1, got 0"):
        GradientSpectrum(x, y, every_n_steps=0)
    with pytest.raises(ValueError, match="`batch_size` must be <= the 4 analysis examples, got 8"):
        GradientSpectrum(x, y, batch_size=8)
    with pytest.raises(ValueError, match="`x` and `y` must hold the same number"):
        GradientSpectrum(x, y[:3])
    with pytest.raises(ValueError, match="`sketch_size` must be an integer >= 1"):
        GradientSpectrum(x, y, sketch_size=0)
    model, x, y = _tiny()
    spectrum = GradientSpectrum(x, y, variables=["missing"])
    spectrum.set_model(model)
    with pytest.raises(ValueError, match="`variables` entry 'missing' is not a layer"):
        spectrum.on_train_begin()


# ---------------------------------------------------------------------- the example
@pytest.mark.slow
@pytest.mark.parametrize("model, suffix", [("cnn", ""), ("transformer", "_transformer")])
def test_gradient_spectra_example_smoke(tmp_path, model, suffix):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gradient_spectra.py"),
                          "--smoke", f"--model={model}", f"--output_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in (f"gradient_spectrum{suffix}.png", f"projected_accuracy{suffix}.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert "DP-SGD projected, k =    4" in out.stdout and "epsilon" in out.stdout
    assert out.stdout.startswith(f"{model}: ")


def test_the_complement_of_a_few_directions_in_high_dimension_needs_no_d_by_d_matrix():
    """Eigen-pairs asked for beyond the streamed rank are completed by orthonormal directions;
    at d = 200,000 a d x d identity (320 GB) must not be built."""
    from tf_dp.analysis.spectra import _complement

    d = 200_000
    rng = np.random.default_rng(0)
    vt, _ = np.linalg.qr(rng.standard_normal((d, 3)))
    vt = vt.T
    extra = _complement(vt, 2)
    assert extra.shape == (2, d)
    both = np.concatenate([vt, extra])
    np.testing.assert_allclose(both @ both.T, np.eye(5), atol=1e-10)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
