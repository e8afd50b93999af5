"""Memory fixes for convolutions (docs/scaling.md section 3 (b)) against float64 brute force.

* A Conv1D/Conv2D whose per-example kernel gradient is materialised anyway (T^2 > d*p, no
  larger than the patches) forms it a chunk of examples at a time, patches included
  (``rules.conv._chunked_kernel_gradient``; strided kernels through space-to-depth
  patches): its per-example gradients, norms, bounds, JL projections and clipped sums must
  equal float64 brute force, for strides, padding, dilation, causal, channels_first, a batch
  that is no multiple of the chunk and an unknown batch; the full-batch patches must not
  appear in the traced graph.
* Both ways of forming a chunk's gradients, one grouped filter gradient (the examples as
  the groups; where ``_grouped_gradient_works``) and patches with a batched product, are
  checked; the probe that decides refuses a kernel that fails or mixes examples.
* Every outer-product term forms its input factor (the patches) under a control dependency
  on its own output gradient (``terms.OuterTerm.factors``): checked on the traced graph.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import _reference as ref  # noqa: E402
from tf_dp.core import build_per_example_loss, clipped_sum, ghost  # noqa: E402
from tf_dp.core.ghost import terms as terms_module  # noqa: E402
from tf_dp.core.ghost.factors import FactorOptions, MaterialisedFactors  # noqa: E402
from tf_dp.core.ghost.rules import conv  # noqa: E402

L = keras.layers
RNG = np.random.default_rng(23)
LOSS = build_per_example_loss("mse")

# name: (input shape, first layer's kwargs, rank, takes the space-to-depth patches)
CASES = {
    "conv2d_s2d_same": ((10, 10, 2), dict(filters=4, kernel_size=4, strides=2,
                                          padding="same"), 2, True),
    "conv2d_s2d_valid_uneven": ((11, 9, 3), dict(filters=3, kernel_size=(4, 3),
                                                 strides=(2, 1), padding="valid"), 2, True),
    "conv2d_s2d_same_odd": ((9, 7, 1), dict(filters=3, kernel_size=(2, 4), strides=(2, 2),
                                            padding="same"), 2, True),
    # p > T, but materialised for exact norms anyway (the tutorial CNN's second convolution)
    # (256 columns: extract_patches, no space-to-depth)
    "conv2d_valid_wide": ((13, 13, 16), dict(filters=32, kernel_size=4, strides=2), 2, False),
    "conv2d_strided_k3": ((9, 9, 2), dict(filters=3, kernel_size=3, strides=2,
                                          padding="same"), 2, False),
    "conv2d_dilated": ((10, 10, 1), dict(filters=2, kernel_size=3, dilation_rate=2), 2, False),
    "conv2d_wide_patches": ((16, 16, 1), dict(filters=2, kernel_size=12, padding="same"), 2,
                            False),
    "conv1d_s2d_same": ((16, 2), dict(filters=3, kernel_size=4, strides=2, padding="same"), 1,
                        True),
    "conv1d_causal_dilated": ((11, 4), dict(filters=3, kernel_size=3, padding="causal",
                                            dilation_rate=2), 1, False),
    "conv2d_channels_first": ((2, 6, 6), dict(filters=2, kernel_size=2,
                                              data_format="channels_first"), 2, False),
}


def _model(name, dtype="float32"):
    shape, kwargs, rank, _ = CASES[name]
    # No activation: a saturated tanh would make float32's and float64's forward passes
    # (not the factors) disagree on the huge example.
    layer = (L.Conv1D if rank == 1 else L.Conv2D)(dtype=dtype, **kwargs)
    return keras.Sequential([keras.Input(shape, dtype=dtype), layer, L.Flatten(dtype=dtype),
                             L.Dense(2, dtype=dtype)])


def _models(name):
    keras.utils.set_random_seed(5)
    m32 = _model(name)
    m64 = _model(name, "float64")
    m64.set_weights([w.astype(np.float64) for w in m32.get_weights()])
    return m32, m64


def _batch(name, n, adversarial=True):
    x = RNG.normal(size=(n,) + CASES[name][0]).astype(np.float32)
    if adversarial:
        x[1] *= 1e6  # huge
        x[2] *= 1e-18  # tiny: products near float32's smallest normal
        x[3, ..., 0] = 0.0  # a dead channel
    y = RNG.normal(size=(n, 2)).astype(np.float32)
    return x, y


def _skip_nchw(name):
    if "channels_first" in name and not ref.cpu_runs_nchw_conv():
        pytest.skip("this TensorFlow build runs no channels_first Conv2D on this CPU")


def _use_path(monkeypatch, path):
    """Force the chunks' gradients through ``path``: "grouped" (skipped where the grouped
    filter gradient does not run) or "patches"."""
    if path == "grouped":
        if not conv._grouped_gradient_works(tf.float32):
            pytest.skip("no grouped filter gradient in this TensorFlow build (oneDNN off)")
    else:
        monkeypatch.setattr(conv, "_GROUPED_WORKS", {"float32": False})


def _chunk_bytes(path, layer, shape, chunk_examples):
    """(attribute, value) that makes chunks of ``chunk_examples`` examples on ``path``."""
    steps = layer.compute_output_shape((1,) + shape)
    steps = int(np.prod(steps[1:])) // layer.filters
    width = int(np.prod(layer.kernel.shape[:-1]))
    if path == "patches":
        return "_CHUNK_BYTES", chunk_examples * steps * width * 4
    per_example = int(np.prod(shape)) + steps * (layer.filters + width) + width * layer.filters
    return "_GROUPED_CHUNK_BYTES", chunk_examples * per_example * 4


def _kernel_factors(model, x, y, w, directions, kinds):
    """The first layer kernel's factors: (per, sq, bound, weighted_sum(w), project)."""
    kernel = model.layers[0].kernel
    with tf.GradientTape() as tape:
        tape.watch([v.value for v in model.trainable_variables])
        with ghost.capture(ghost.capturable_layers(model), tf.shape(x)[0], tape) as ctx:
            pred = model(x, training=True)
        total = tf.reduce_sum(LOSS(y, pred, None))
    kinds.append([type(t).__name__ for t in ctx.terms()[id(kernel)][1]])
    f = ghost.backward(ctx, tape, total, FactorOptions())[id(kernel)]
    kinds.append(type(f).__name__)
    assert isinstance(f, MaterialisedFactors)
    return f.per, f.sq, f.bound, f.weighted_sum(w), f.project(directions)


@pytest.mark.parametrize("traced,chunk_examples", [
    ("eager", 3), ("static_batch", 3), ("unknown_batch", 3),
    ("static_batch", 1000)])  # one chunk: no loop
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", ["grouped", "patches"])
def test_chunked_kernel_gradients_match_float64_brute_force(path, name, chunk_examples, traced,
                                                            monkeypatch):
    _skip_nchw(name)
    _use_path(monkeypatch, path)
    m32, m64 = _models(name)
    shape, kwargs, rank, s2d = CASES[name]
    # dilated kernels: no grouped filter gradient on CPU (patches)
    grouped = path == "grouped" and "dilat" not in name
    s2d = s2d and not grouped
    assert conv._direct_kernel_gradient(m32.layers[0], tf.zeros((1,) + shape),
                                        m32.layers[0](tf.zeros((1,) + shape)))
    # Chunks of `chunk_examples` examples: 7 is no multiple of 3 (two padded examples).
    attr, value = _chunk_bytes("grouped" if grouped else "patches", m32.layers[0], shape,
                               chunk_examples)
    monkeypatch.setattr(conv, attr, value)
    chunks, grouped_calls = [], []
    in_chunks, grouped_fn = conv._in_chunks, conv._grouped_gradient
    monkeypatch.setattr(conv, "_in_chunks",
                        lambda *a, **kw: chunks.append(a[3]) or in_chunks(*a, **kw))
    monkeypatch.setattr(conv, "_grouped_gradient",
                        lambda *a: grouped_calls.append(1) or grouped_fn(*a))
    n = 7
    x, y = _batch(name, n)
    w = RNG.uniform(size=n).astype(np.float32)
    kshape = tuple(m32.layers[0].kernel.shape)
    v = RNG.normal(size=(2,) + kshape).astype(np.float32)
    s2d_calls = []
    original = conv._s2d_patches
    monkeypatch.setattr(conv, "_s2d_patches", lambda *a: s2d_calls.append(1) or original(*a))
    kinds = []
    fn = lambda a, b: _kernel_factors(m32, a, b, tf.constant(w), tf.constant(v), kinds)  # noqa
    if traced == "static_batch":
        fn = tf.function(fn)
    elif traced == "unknown_batch":
        fn = tf.function(fn, input_signature=[tf.TensorSpec((None,) + shape),
                                              tf.TensorSpec([None, 2])])
    per, sq, bound, wsum, proj = [t.numpy() for t in fn(tf.constant(x), tf.constant(y))]
    assert kinds[0] == ["DirectTerm"]
    assert kinds[1] == "MaterialisedFactors"
    assert bool(s2d_calls) == s2d
    assert bool(grouped_calls) == grouped
    assert chunks and set(chunks) == {chunk_examples}

    bf = ref.per_example_gradients(m64, LOSS, x.astype(np.float64), y.astype(np.float64),
                                   variables=[m64.layers[0].kernel])[0]
    assert per.reshape(n, -1).shape[1] == int(np.prod(kshape))
    per64 = per.astype(np.float64).reshape(n, -1)
    bf = bf.reshape(n, -1)
    scale = np.max(np.abs(bf), axis=1, keepdims=True)
    err = np.abs(per64 - bf) / (scale + 1e-300)
    assert np.all((err <= 1e-5) | (np.abs(per64 - bf) <= 1e-37)), np.max(err, axis=1)
    # The bound is at least the exact norm of what the weighted sum adds (the float32 per).
    exact = np.sqrt(np.sum(per64 ** 2, axis=1))
    assert np.all(bound >= exact)
    # (squares below float32's smallest normal are flushed: the bound's absolute term)
    np.testing.assert_allclose(sq, exact ** 2, rtol=2e-6, atol=per64.shape[1] * 2.0**-126)
    np.testing.assert_allclose(exact, np.sqrt(np.sum(bf ** 2, axis=1)), rtol=1e-5)
    # Each example's entries are within 1e-5 of its scale (above), so the weighted sum's are
    # within 1e-5 * sum_i w_i scale_i (an atol from the largest entry of the sum failed when
    # the sum cancelled: 2 of 8192 entries at 1e-4 of it, for some draws of the data).
    np.testing.assert_allclose(wsum.reshape(-1), w.astype(np.float64) @ bf,
                               rtol=1e-5, atol=1e-5 * float(np.abs(w) @ scale[:, 0]))
    np.testing.assert_allclose(proj, v.reshape(2, -1).astype(np.float64) @ bf.T,
                               rtol=1e-4, atol=1e-5 * np.max(np.abs(bf)) * 10)


def test_space_to_depth_patches_are_a_permutation_of_the_patches():
    for shape, k, s, padding in [((9, 12, 3), (4, 6), (2, 3), "same"),
                                 ((10, 7, 2), (2, 2), (2, 2), "valid"),
                                 ((8, 8, 1), (8, 8), (2, 2), "same"),
                                 ((13, 13, 16), (4, 4), (2, 2), "valid"),
                                 ((5, 11, 2), (1, 4), (1, 2), "same")]:
        x = tf.constant(RNG.normal(size=(3,) + shape).astype(np.float32))
        want = conv._flat_patches(x, k, s, (1, 1), padding).numpy()
        got, columns = conv._s2d_patches(x, k, s, padding)
        assert sorted(columns) == list(range(len(columns)))
        np.testing.assert_array_equal(tf.gather(got, columns, axis=2).numpy(), want)


@pytest.mark.parametrize("n", [0, 1, 5, 6, 7, 13])
def test_in_chunks_covers_every_example_once(n):
    # small integers: every product and sum exact, whatever order a kernel takes
    x = tf.constant(RNG.integers(-3, 4, size=(n, 4, 3)).astype(np.float32))
    g = tf.constant(RNG.integers(-3, 4, size=(n, 4, 2)).astype(np.float32))
    fn = lambda a, b: tf.einsum("btd,btp->bdp", a, b)  # noqa: E731
    want = fn(x, g).numpy()
    for chunk in (1, 3, 6, 100):
        np.testing.assert_array_equal(conv._in_chunks(fn, x, g, chunk, 3, 2).numpy(), want)
        traced = tf.function(lambda a, b, c=chunk: conv._in_chunks(fn, a, b, c, 3, 2),
                             input_signature=[tf.TensorSpec([None, 4, 3]),
                                              tf.TensorSpec([None, 4, 2])])
        np.testing.assert_array_equal(traced(x, g).numpy(), want)


@pytest.mark.parametrize("n", [1, 5, 6, 7, 13])
def test_in_chunks_writes_every_row_of_its_uninitialised_buffer(n, monkeypatch):
    # The buffer is uninitialised memory (Empty): a row no chunk wrote would hold whatever
    # was there before, possibly another example's data (a mixed example breaks the clip
    # bound). Here the buffer starts as NaN: every row must be overwritten, for every
    # chunking and batch, eager and traced.
    def poisoned(shape, dtype, init=False):
        return tf.fill(shape, tf.constant(np.nan, dtype))

    monkeypatch.setattr(conv.tf.raw_ops, "Empty", poisoned)
    x = tf.constant(RNG.integers(-3, 4, size=(n, 4, 3)).astype(np.float32))
    g = tf.constant(RNG.integers(-3, 4, size=(n, 4, 2)).astype(np.float32))
    fn = lambda a, b: tf.einsum("btd,btp->bdp", a, b)  # noqa: E731
    want = fn(x, g).numpy()
    for chunk in (1, 2, 3, 4):
        got = conv._in_chunks(fn, x, g, chunk, 3, 2).numpy()
        assert not np.isnan(got).any() and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        traced = tf.function(lambda a, b, c=chunk: conv._in_chunks(fn, a, b, c, 3, 2),
                             input_signature=[tf.TensorSpec([None, 4, 3]),
                                              tf.TensorSpec([None, 4, 2])])
        np.testing.assert_array_equal(traced(x, g).numpy(), want)


def _norms_and_grads(res):
    return res.norms, res.grads


@pytest.mark.parametrize("name", ["conv2d_s2d_same", "conv1d_causal_dilated",
                                  "conv2d_channels_first"])
@pytest.mark.parametrize("path", ["grouped", "patches"])
def test_clipped_sum_with_chunks_and_unknown_batch_matches_brute_force(path, name,
                                                                       monkeypatch):
    _skip_nchw(name)
    _use_path(monkeypatch, path)
    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)  # one example per chunk
    monkeypatch.setattr(conv, "_GROUPED_CHUNK_BYTES", 1)
    m32, m64 = _models(name)
    x, y = _batch(name, 5, adversarial=False)
    norms, sums = ref.clipped_sum_reference(m64, LOSS, x.astype(np.float64),
                                            y.astype(np.float64), 1.0)
    clip = float(np.min(norms)) * 0.5  # every example clipped
    norms, sums = ref.clipped_sum_reference(m64, LOSS, x.astype(np.float64),
                                            y.astype(np.float64), clip)
    fn = tf.function(lambda a, b: _norms_and_grads(clipped_sum(m32, a, b, None, LOSS, clip)),
                     input_signature=[tf.TensorSpec((None,) + x.shape[1:]),
                                      tf.TensorSpec([None, 2])])
    got_norms, grads = fn(tf.constant(x), tf.constant(y))
    np.testing.assert_allclose(got_norms.numpy(), norms, rtol=1e-5)
    for got, want in zip(grads, sums):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def _function_ops(graph, op_type):
    """Nodes of type ``op_type`` in the functions ``graph`` calls (while bodies, ...)."""
    return [n for f in graph.as_graph_def().library.function for n in f.node_def
            if n.op == op_type]


def _trace(model, shape):
    fn = tf.function(lambda a, b: clipped_sum(model, a, b, None, LOSS, 1.0).grads,
                     input_signature=[tf.TensorSpec((None,) + shape),
                                      tf.TensorSpec([None, 2])])
    return fn.get_concrete_function().graph


def _wide_patches_graph(monkeypatch, path):
    """The traced clipped sum (batch unknown) of the 12x12-kernel case on ``path``, in
    chunks of 64 KiB (several chunks per batch)."""
    _use_path(monkeypatch, path)
    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(conv, "_GROUPED_CHUNK_BYTES", 1 << 16)
    keras.utils.set_random_seed(5)
    return _trace(_model("conv2d_wide_patches"), CASES["conv2d_wide_patches"][0])


def test_the_whole_batch_patches_of_a_direct_kernel_gradient_are_never_formed(monkeypatch):
    # 12x12 patches of one channel (144 > 128 columns: tf.image.extract_patches): with the
    # batch unknown the patches exist only inside the loop over chunks.
    graph = _wide_patches_graph(monkeypatch, "patches")
    outer = [op for op in graph.get_operations() if op.type == "ExtractImagePatches"]
    assert not outer
    assert _function_ops(graph, "ExtractImagePatches")  # the chunks' own


@pytest.mark.parametrize("path", ["grouped", "patches"])
def test_the_chunks_are_written_into_one_buffer(path, monkeypatch):
    # Each chunk's per-example gradients go into their rows of one (B, width, filters)
    # buffer, in place (rules.conv._write_block): no TensorList of them, no concatenation
    # (chunks and their concatenated copy were both alive at the step's memory peak).
    graph = _wide_patches_graph(monkeypatch, path)
    lists = [op for op in graph.get_operations()
             if op.type in ("TensorListConcatV2", "TensorListReserve")]
    assert not lists, [op.name for op in lists]
    assert len(_function_ops(graph, "InplaceUpdate")) == 1  # in the loop over chunks
    empty = [op for op in graph.get_operations() if op.type == "Empty"]
    assert len(empty) == 1
    # allocated once the output gradient exists, not at the start of the step
    assert any(name.startswith("gradient_tape/") for name in _ancestors(empty[0]))


def _two_twin_convolutions():
    """Two Conv2D layers with kernels of the same shape, fed the same input shape: their
    buffers have equal shapes (a buffer merged with the other would swap gradients)."""
    keras.utils.set_random_seed(8)
    inp = keras.Input((9, 9, 2))
    a = L.Conv2D(4, 3, strides=2, padding="same", activation="tanh")(inp)
    b = L.Conv2D(4, 3, strides=2, padding="same", activation="tanh")(inp)
    out = L.Dense(2)(L.Flatten()(L.Concatenate()([a, b])))
    return keras.Model(inp, out)


@pytest.mark.parametrize("path", ["grouped", "patches"])
def test_in_place_buffers_of_twin_layers_and_of_successive_steps_stay_apart(path,
                                                                           monkeypatch):
    # The adversarial cases of an in-place buffer: two layers whose buffers have the same
    # shape (merged, one layer's gradients would overwrite the other's), and the same
    # traced step called again (a buffer reused across calls would overwrite the gradients
    # the first call returned). Each kernel's per-example gradients are checked against
    # float64 brute force, and the first call's result after the second call.
    _use_path(monkeypatch, path)
    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)  # one example per chunk
    monkeypatch.setattr(conv, "_GROUPED_CHUNK_BYTES", 1)
    m32 = _two_twin_convolutions()
    kernels = [m32.layers[1].kernel, m32.layers[2].kernel]

    @tf.function(input_signature=[tf.TensorSpec([None, 9, 9, 2]), tf.TensorSpec([None, 2])])
    def per_example(x, y):
        with tf.GradientTape() as tape:
            tape.watch([v.value for v in m32.trainable_variables])
            with ghost.capture(ghost.capturable_layers(m32), tf.shape(x)[0], tape) as ctx:
                pred = m32(x, training=True)
            total = tf.reduce_sum(LOSS(y, pred, None))
        f = ghost.backward(ctx, tape, total, FactorOptions())
        return [f[id(k)].per for k in kernels]

    def brute(x, y):
        # one example at a time (the float32 model: agreement to float32 rounding)
        return ref.per_example_gradients(m32, LOSS, x, y, variables=kernels)

    x1, y1 = (RNG.normal(size=(5, 9, 9, 2)).astype(np.float32),
              RNG.normal(size=(5, 2)).astype(np.float32))
    x2, y2 = (RNG.normal(size=(5, 9, 9, 2)).astype(np.float32),
              RNG.normal(size=(5, 2)).astype(np.float32))
    first = per_example(tf.constant(x1), tf.constant(y1))
    kept = [t.numpy().copy() for t in first]
    second = per_example(tf.constant(x2), tf.constant(y2))
    for got, want in zip(kept, brute(x1, y1)):
        np.testing.assert_allclose(got.reshape(5, -1), want.reshape(5, -1), rtol=1e-4,
                                   atol=1e-6)
    for got, want in zip(second, brute(x2, y2)):
        np.testing.assert_allclose(got.numpy().reshape(5, -1), want.reshape(5, -1),
                                   rtol=1e-4, atol=1e-6)
    for t, k in zip(first, kept):  # the first call's tensors were not written again
        np.testing.assert_array_equal(t.numpy(), k)
    assert not np.allclose(kept[0], second[0].numpy())


def test_grouped_chunks_form_no_patches(monkeypatch):
    # The grouped path: one grouped filter gradient per chunk, inside the loop, and no
    # patches anywhere (oneDNN forms its own per chunk).
    graph = _wide_patches_graph(monkeypatch, "grouped")
    assert not [op for op in graph.get_operations() if op.type == "ExtractImagePatches"]
    # (the main graph also holds the tape's unused batch filter gradient: pruned at run time)
    assert len(_function_ops(graph, "Conv2DBackpropFilter")) == 1
    assert not _function_ops(graph, "ExtractImagePatches")


def _mixing(fn):
    """``fn`` with each example's gradient replaced by its neighbour's (mixes examples)."""
    return lambda *a: tf.roll(fn(*a), 1, axis=0)


def test_the_probe_takes_only_a_grouped_gradient_that_is_each_examples_own(monkeypatch,
                                                                           caplog):
    # float64: TensorFlow's CPU kernels have no grouped filter gradient: refused, logged
    assert not conv._probe_grouped(tf.float64)
    assert not conv._grouped_gradient_works(tf.float64)
    if not conv._probe_grouped(tf.float32):
        pytest.skip("no grouped filter gradient in this TensorFlow build (oneDNN off)")
    # A kernel that ran but mixed the examples (or put a channel in the wrong place)
    # would break the clip bound: the probe refuses it, with a warning.
    original = conv._grouped_gradient
    monkeypatch.setattr(conv, "_grouped_gradient", _mixing(original))
    with caplog.at_level("WARNING", logger="tf_dp"):
        assert not conv._probe_grouped(tf.float32)
    assert "does not give each example's own" in caplog.text
    monkeypatch.setattr(conv, "_grouped_gradient",
                        lambda *a: tf.reverse(original(*a), axis=[2]))
    assert not conv._probe_grouped(tf.float32)


def test_a_refused_grouped_gradient_falls_back_to_patches(monkeypatch):
    # What the step does with the probe's answer: with it refused (here by a kernel that
    # mixes examples) the chunks take patches, and the gradients are the examples' own.
    monkeypatch.setattr(conv, "_GROUPED_WORKS", {})
    monkeypatch.setattr(conv, "_grouped_gradient", _mixing(conv._grouped_gradient))
    layer = keras.layers.Conv2D(3, 3, strides=2, padding="same")
    layer.build((None, 9, 9, 2))
    x = tf.constant(RNG.integers(-3, 4, size=(5, 9, 9, 2)).astype(np.float32))
    dz = tf.constant(RNG.integers(-3, 4, size=(5, 5, 5, 3)).astype(np.float32))
    from tf_dp.core.ghost.terms import rows
    got = conv._chunked_kernel_gradient(layer, x, "same", rows, out_spatial=(5, 5))(dz)
    assert conv._GROUPED_WORKS == {"float32": False}
    want = np.stack([tf.raw_ops.Conv2DBackpropFilter(
        input=x[b:b + 1], filter_sizes=[3, 3, 2, 3], out_backprop=dz[b:b + 1],
        strides=[1, 2, 2, 1], padding="SAME").numpy() for b in range(5)])
    np.testing.assert_array_equal(got.numpy(), want)


def _ancestors(op):
    return {o.name for o in ref.ancestor_ops(op)}


def test_patches_of_an_outer_term_wait_for_their_output_gradient():
    # T^2 <= d*p (9 positions, 256 x 32 kernel): an outer-product term on the patches
    # (256 columns: tf.image.extract_patches). Without the control dependency the patches
    # depend on the forward pass only and the executor may form them before the backward
    # pass (and hold them through it).
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((6, 6, 16)), L.Conv2D(32, 4, activation="tanh"),
                              L.Flatten(), L.Dense(2)])
    assert not conv._direct_kernel_gradient(model.layers[0], tf.zeros((1, 6, 6, 16)),
                                            tf.zeros((1, 3, 3, 32)))
    graph = _trace(model, (6, 6, 16))
    patches = [op for op in graph.get_operations() if op.type == "ExtractImagePatches"]
    assert len(patches) == 1
    assert any(name.startswith("gradient_tape/") for name in _ancestors(patches[0]))
    # and the model's forward convolution does not (the test can tell the two apart)
    forward = [op for op in graph.get_operations() if op.type == "Conv2D"]
    assert forward and not any(
        any(n.startswith("gradient_tape/") for n in _ancestors(op)) for op in forward)


def test_input_factor_of_every_outer_term_is_made_after_its_gradient():
    # The same for any outer-product term (Dense, EinsumDense, recurrent kernels): the op
    # a_fn makes has the term's output gradient among its ancestors.
    @tf.function(input_signature=[tf.TensorSpec([None, 3, 4])], autograph=False)
    def run(x):
        z = x * 2.0
        dz = tf.identity(z * 3.0, name="the_gradient")
        term = terms_module.OuterTerm(z, lambda: tf.reshape(x, [-1, 3, 4], name="factor"))
        return term.factors(dz)

    graph = run.get_concrete_function().graph
    assert "the_gradient" in _ancestors(graph.get_operation_by_name("factor"))


def test_factors_of_weights_larger_than_their_output_gradient_wait_for_the_backward_pass():
    # A weight larger than its output gradient per example (conv2: 1152 > 576, the Dense
    # head) gets its factors after every recorded output gradient exists: its per-example
    # product is formed after conv1's output gradient (which conv2's Conv2DBackpropInput
    # produces), not during the rest of the backward pass, where it would be held next to
    # its activations and gradients (docs/scaling.md section 7). Without ghost.backward's
    # control dependency the Dense factors do not depend on that op.
    from tf_dp.core.norm_strategies import _Batch, _ghost_pass

    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((10, 10, 3)), L.Conv2D(8, 3, activation="tanh"),
                              L.Conv2D(16, 3, activation="tanh"), L.Flatten(), L.Dense(2)])

    formed = []  # the names of the ops that form them (the returned tensors are copies
    # that wait for every stateful op of the function, the buffers of per-example
    # gradients included)

    @tf.function(input_signature=[tf.TensorSpec([None, 10, 10, 3]),
                                  tf.TensorSpec([None, 2])], autograph=False)
    def run(a, b):
        batch = _Batch(model, a, b, None, LOSS, model.trainable_variables, "error")
        by_id, _, _ = _ghost_pass(batch, FactorOptions())
        for v in (model.layers[1].kernel, model.layers[3].kernel, model.layers[1].bias):
            f = by_id[id(v)]
            formed.append([t.op.name for t in (getattr(f, "per", None), getattr(f, "g", None))
                           if t is not None])
        return a

    graph = run.get_concrete_function().graph
    # conv2's gradient with respect to its input, conv1's output (8, 8, 8); not the one
    # into the model's input (10, 10, 3).
    into_conv1 = [op.name for op in graph.get_operations()
                  if op.type == "Conv2DBackpropInput"
                  and op.outputs[0].shape.as_list()[1:] == [8, 8, 8]]
    assert len(into_conv1) == 1, into_conv1
    conv2_kernel, dense_kernel, conv2_bias = [[graph.get_operation_by_name(n) for n in names]
                                              for names in formed]
    for op in conv2_kernel + dense_kernel:
        assert into_conv1[0] in _ancestors(op), op.name
    # A small weight's (conv2's bias: 16 < 576) is formed as soon as its gradient exists.
    assert conv2_bias and not any(into_conv1[0] in _ancestors(op) for op in conv2_bias)


def test_a_later_layers_buffer_does_not_wait_for_an_earlier_layers_gradient():
    # Buffers of per-example gradients are stateful ops (Empty), which tf.function runs in
    # the order they were made. Two small direct-kernel convolutions (both formed as soon
    # as their output gradient exists): the second's buffer must not wait for the first's
    # output gradient (made by the second's Conv2DBackpropInput, late in the backward
    # pass), as it would if the buffers were made in the forward order (ghost.backward
    # forms the weights' factors last layer first).
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((12, 12, 1)),
                              L.Conv2D(4, 3, padding="same", activation="tanh"),
                              L.Conv2D(4, 3, padding="same", activation="tanh"),
                              L.Flatten(), L.Dense(2)])
    for layer, shape in ((model.layers[0], (1, 12, 12, 1)), (model.layers[1], (1, 12, 12, 4))):
        z = layer(tf.zeros(shape))
        assert conv._direct_kernel_gradient(layer, tf.zeros(shape), z)
        assert layer.kernel.shape.num_elements() <= z.shape[1:].num_elements()  # not delayed
    graph = _trace(model, (12, 12, 1))
    empties = [op for op in graph.get_operations() if op.type == "Empty"]
    assert len(empties) == 2
    into_first = [op.name for op in graph.get_operations()
                  if op.type == "Conv2DBackpropInput"
                  and op.outputs[0].shape.as_list()[1:] == [12, 12, 4]]
    assert len(into_first) == 1
    waits = [into_first[0] in _ancestors(op) for op in empties]
    assert sorted(waits) == [False, True], waits  # the first layer's own buffer waits



def _direct_cnn():
    """Two convolutions whose kernels take the chunked, in-place path (T^2 > d*p, p <= T:
    25 positions against 32 x 4 and 36 x 3), then a dense head."""
    model = keras.Sequential([
        keras.Input((10, 10, 2)),
        L.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
        L.Conv2D(3, 3, padding="same", activation="tanh"),
        L.Flatten(), L.Dense(1)])
    rng = np.random.default_rng(41)
    model.set_weights([rng.normal(0.0, 0.5, size=w.shape).astype("float32")
                       for w in model.weights])
    return model


@pytest.mark.filterwarnings("ignore:tf_dp. training on a dataset of fixed")
@pytest.mark.parametrize("path", ["grouped", "patches"])
def test_in_place_buffers_inside_the_micro_batch_loop_give_the_one_batch_step(path,
                                                                              monkeypatch):
    # Gradient accumulation runs the clipped sum in a tf.while_loop over micro-batches: each
    # iteration must form its own buffers, fully written before they are read (a buffer
    # shared by iterations, or read before its last chunk, would mix micro-batches). With
    # one example per chunk, k = 3 micro-batches of 3, 3 and 4 examples must give the
    # weights of k = 1 (whose per-example gradients the tests above pin to brute force),
    # clipping active, over two steps.
    from tf_dp.keras import make_private
    from tf_dp.optimizers import DPSGD

    _use_path(monkeypatch, path)
    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(conv, "_GROUPED_CHUNK_BYTES", 1)
    calls = []
    in_chunks = conv._in_chunks
    monkeypatch.setattr(conv, "_in_chunks", lambda *a: calls.append(1) or in_chunks(*a))
    x = RNG.normal(size=(10, 10, 10, 2)).astype(np.float32)
    y = RNG.normal(size=(10, 1)).astype(np.float32)
    runs = []
    for k in (1, 3):
        model = make_private(_direct_cnn())
        model.compile(optimizer=DPSGD(0.2, 0.0, learning_rate=0.5, seed=1,
                                      gradient_accumulation_steps=k), loss="mse")
        model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(2), epochs=1, verbose=0,
                  dataset_size=len(x))
        runs.append(model.get_weights())
    assert calls  # the chunked, in-place path ran
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(runs[0],
                                                             _direct_cnn().get_weights()))
    assert moved > 1e-3
    for got, want in zip(runs[1], runs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
