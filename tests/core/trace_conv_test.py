"""A convolution kernel's per-example gradient formed a chunk of examples at a time (batch
unknown: a loop) is a plain while loop over the chunks writing into one buffer (issue 14:
``tf.map_fn`` over the chunk indices made a third more graph ops, traced twice and optimised
at the private step's first call). Values: tests/core/conv_memory_test.py (brute force, every
chunking, B = 0).
"""

import collections
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core.ghost.rules import conv
from tf_dp.core.ghost.terms import rows


def _graph(batch=None):
    # The tutorial CNN's first convolution: per-example gradient formed directly, in chunks.
    layer = keras.layers.Conv2D(16, 8, strides=2, padding="same")
    layer.build((None, 28, 28, 1))
    spec = [tf.TensorSpec([batch, 28, 28, 1]), tf.TensorSpec([batch, 14, 14, 16])]

    @tf.autograph.experimental.do_not_convert
    def grads(x, dz):
        return conv._chunked_kernel_gradient(layer, x, "same", rows, out_spatial=(14, 14))(dz)

    return tf.function(grads, input_signature=spec).get_concrete_function().graph


def _ops(graph):
    main = collections.Counter(op.type for op in graph.get_operations())
    functions = collections.Counter(n.op for f in graph.as_graph_def().library.function
                                    for n in f.node_def)
    return main, functions


def test_chunks_of_an_unknown_batch_are_one_plain_loop():
    main, functions = _ops(_graph())
    assert main["StatelessWhile"] + main["While"] == 1, main
    # The chunk indices are the loop counter, not a TensorArray of tf.range (map_fn's
    # TensorListFromTensor and its per-iteration TensorListGetItem); each chunk is written
    # into its block of one buffer in place (no TensorList of chunks, no concatenation).
    assert main["TensorListFromTensor"] == 0 and functions["TensorListGetItem"] == 0
    assert main["TensorListReserve"] == 0 and main["TensorListConcatV2"] == 0, main
    assert main["Empty"] == 1 and functions["InplaceUpdate"] == 1, (main, functions)
    assert functions["Pad"] <= 2, functions  # the last chunk's rows, to a full block
    # Around the loop: the batch, n = ceil(B / chunk) and c = ceil(B / n) (a dozen ops with
    # their constants), the buffer, the loop, the result's reshape and slice, and the
    # NoOp by which tf.function's return waits for the (stateful) buffer op.
    assert sum(main.values()) <= 48, main  # 53 with map_fn


def test_a_static_batch_within_one_chunk_has_no_loop():
    main, functions = _ops(_graph(batch=8))
    assert not functions and main["StatelessWhile"] + main["While"] == 0, (main, functions)


@pytest.mark.parametrize("batch", [0, 1, 29, 30, 83, 84, 167, 256])
@pytest.mark.parametrize("path", ["grouped", "patches"])
def test_same_values_as_one_chunk(path, batch, monkeypatch):
    # chunks of 83 examples (patches) or 29 (grouped filter gradients)
    if path == "patches":
        monkeypatch.setattr(conv, "_GROUPED_WORKS", {"float32": False})
    elif not conv._grouped_gradient_works(tf.float32):
        pytest.skip("no grouped filter gradient in this TensorFlow build (oneDNN off)")
    layer = keras.layers.Conv2D(16, 8, strides=2, padding="same")
    layer.build((None, 28, 28, 1))
    rng = np.random.default_rng(batch)
    x = tf.constant(rng.normal(size=(batch, 28, 28, 1)).astype(np.float32))
    dz = tf.constant(rng.normal(size=(batch, 14, 14, 16)).astype(np.float32))
    fn = tf.function(lambda a, b: conv._chunked_kernel_gradient(
        layer, a, "same", rows, out_spatial=(14, 14))(b),
                     input_signature=[tf.TensorSpec([None, 28, 28, 1]),
                                      tf.TensorSpec([None, 14, 14, 16])])
    got = fn(x, dz).numpy()
    assert got.shape == (batch, 8, 8, 1, 16)
    if batch:
        a = conv._flat_patches(x, (8, 8), (2, 2), (1, 1), "same")
        want = tf.einsum("btd,btp->bdp", a, rows(dz)).numpy().reshape(got.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
