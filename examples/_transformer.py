"""Shared by the text examples: a small Transformer-encoder classifier over integer tokens.

Token Embedding + learned positional Embedding -> num_blocks x [multi-head self-attention ->
Add -> LayerNorm -> Dense(ff, relu) -> Dense -> Add -> LayerNorm] -> masked mean pooling ->
Dense(num_classes), zero-initialised. Token id 0 is padding (TextVectorization's convention).

attention="functional" writes the attention out with its four EinsumDense projections as
top-level layers (the same math and equations as keras.layers.MultiHeadAttention), so that
`tf_dp.layers.reparametrize`, which clones top-level layers only, can swap them;
attention="keras" uses keras.layers.MultiHeadAttention.
"""

import math

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class Positions(keras.layers.Layer):
    """Position ids ``[0, T)`` for every example; weightless, so the table is an Embedding
    (which has an exact per-example norm formula)."""

    def call(self, tokens):
        length = tf.shape(tokens)[1]
        return tf.broadcast_to(tf.range(length)[None, :], tf.shape(tokens))


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class ScaledDotProductAttention(keras.layers.Layer):
    """``softmax(q kᵀ / sqrt(d) + mask) v`` per head; weightless.

    Inputs ``[q, k, v, tokens]`` with ``q, k, v`` of shape ``(B, T, heads, d)``; keys at
    padding tokens (id 0) are masked out.
    """

    def call(self, inputs):
        query, key, value, tokens = inputs
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
        scores = tf.einsum("bqhd,bkhd->bhqk", query * scale, key)
        keep = tf.cast(tokens > 0, scores.dtype)[:, None, None, :]
        scores += (1.0 - keep) * -1e9
        return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, axis=-1), value)


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class MaskedMeanPooling(keras.layers.Layer):
    """Mean over the non-padding positions of ``(B, T, D)``; inputs ``[x, tokens]``."""

    def call(self, inputs):
        x, tokens = inputs
        keep = tf.cast(tokens > 0, x.dtype)[:, :, None]
        return tf.reduce_sum(x * keep, axis=1) / tf.maximum(tf.reduce_sum(keep, axis=1), 1.0)


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class AttentionMask(keras.layers.Layer):
    """``(B, 1, T)`` boolean mask of the non-padding keys, for MultiHeadAttention."""

    def call(self, tokens):
        return (tokens > 0)[:, None, :]


def _functional_attention(x, tokens, name, num_heads, embed_dim):
    """Self-attention with MultiHeadAttention's EinsumDense equations, as top-level layers."""
    head_dim = embed_dim // num_heads

    def projection(part):
        return keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, num_heads, head_dim),
                                        bias_axes="de", name=f"{name}_{part}")(x)

    attended = ScaledDotProductAttention(name=f"{name}_sdpa")(
        [projection("query"), projection("key"), projection("value"), tokens])
    return keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, embed_dim),
                                    bias_axes="e", name=f"{name}_output")(attended)


def _keras_attention(x, tokens, name, num_heads, embed_dim):
    mask = AttentionMask(name=f"{name}_mask")(tokens)
    return keras.layers.MultiHeadAttention(num_heads, embed_dim // num_heads,
                                           name=f"{name}_mha")(x, x, attention_mask=mask)


def transformer_classifier(vocab_size: int, sequence_length: int, embed_dim: int,
                           num_heads: int, ff_dim: int, num_blocks: int = 1,
                           attention: str = "functional", num_classes: int = 2) -> keras.Model:
    """The encoder classifier (integer tokens ``(B, sequence_length)`` -> logits)."""
    if attention not in ("functional", "keras"):
        raise ValueError(f"`attention` must be 'functional' or 'keras', got {attention!r}.")
    tokens = keras.Input((sequence_length,), dtype="int64", name="tokens")
    x = keras.layers.Embedding(vocab_size, embed_dim, name="token_embedding")(tokens)
    positions = keras.layers.Embedding(sequence_length, embed_dim,
                                       name="position_embedding")(Positions()(tokens))
    x = keras.layers.Add()([x, positions])
    attend = _functional_attention if attention == "functional" else _keras_attention
    for i in range(num_blocks):
        name = f"block{i}"
        # keras.layers.Add, not `x + y`: reparametrize() fails on operator nodes.
        x = keras.layers.Add()([x, attend(x, tokens, f"{name}_attention", num_heads, embed_dim)])
        x = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
        y = keras.layers.Dense(ff_dim, activation="relu", name=f"{name}_ff1")(x)
        y = keras.layers.Dense(embed_dim, name=f"{name}_ff2")(y)
        x = keras.layers.LayerNormalization(name=f"{name}_ln2")(keras.layers.Add()([x, y]))
    pooled = MaskedMeanPooling()([x, tokens])
    # Zero-initialised classifier: the first steps start from the uniform prediction (loss
    # log 2) instead of from random logits, which noisy private steps are slow to undo.
    logits = keras.layers.Dense(num_classes, kernel_initializer="zeros", name="classifier")(pooled)
    return keras.Model(tokens, logits)
