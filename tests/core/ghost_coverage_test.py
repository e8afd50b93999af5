"""Every built-in Keras 3 layer class, classified by how the private step gets its weights'
per-example gradients, and each class with trainable weights checked against brute force.

* "ghost": ``norm_strategy="ghost"`` succeeds (every weight covered by a ghost rule) and its
  norms and clipped sums equal a loop over single examples;
* "fallback": no rule; ``norm_strategy="ghost"`` refuses the model and ``"auto"`` (exact
  vectorized per-example gradients for it) equals the loop;
* "refused": the private step refuses the layer (it mixes examples);
* "no trainable weights" and "not applicable" (other backends, abstract bases).

``CLASSIFICATION`` must list every layer class ``keras.layers`` exports: a new Keras layer
fails ``test_every_keras_layer_is_classified`` until it is classified here (and in the table
of docs/extending.md, which ``test_docs_table_matches`` compares with ``CLASSIFICATION``).
Models are float64, so the reference is exact to float64 rounding; the ghost cases run in
float32 too.
"""

import functools
import inspect
import os
import sys
import tempfile

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
from tf_dp.core import build_per_example_loss, carrier_for, clipped_sum, ghost  # noqa: E402
from tf_dp.core.ghost import registry  # noqa: E402

L = keras.layers
R = tf_dp.layers

GHOST, FALLBACK, REFUSED = "ghost", "fallback", "refused"
NO_WEIGHTS, NOT_APPLICABLE = "no trainable weights", "not applicable"

_RULES = "tf_dp.core.ghost.rules."

# class name -> (kind, where the rule lives / why not). Ghost entries name the module of the
# rule (checked against ``rule_for``), or "via ..." for layers covered through sublayers.
CLASSIFICATION = {
    # ------------------------------------------------------------------------- ghost
    "Dense": (GHOST, _RULES + "dense"),
    "EinsumDense": (GHOST, _RULES + "einsum"),
    "Embedding": (GHOST, _RULES + "embedding"),
    "Conv1D": (GHOST, _RULES + "conv"),
    "Conv2D": (GHOST, _RULES + "conv"),
    "Conv3D": (GHOST, _RULES + "conv"),
    "DepthwiseConv1D": (GHOST, _RULES + "conv"),
    "DepthwiseConv2D": (GHOST, _RULES + "conv"),
    "SeparableConv1D": (GHOST, _RULES + "conv"),
    "SeparableConv2D": (GHOST, _RULES + "conv"),
    "Conv1DTranspose": (GHOST, _RULES + "conv"),
    "Conv2DTranspose": (GHOST, _RULES + "conv"),
    "Conv3DTranspose": (GHOST, _RULES + "conv"),
    "LayerNormalization": (GHOST, _RULES + "normalization"),
    "GroupNormalization": (GHOST, _RULES + "normalization"),
    "LSTM": (GHOST, _RULES + "recurrent"),
    "GRU": (GHOST, _RULES + "recurrent"),
    "SimpleRNN": (GHOST, _RULES + "recurrent"),
    "Bidirectional": (GHOST, "via the rules of the wrapped LSTM / GRU / SimpleRNN"),
    "MultiHeadAttention": (GHOST, "via its EinsumDense sublayers"),
    "GroupQueryAttention": (GHOST, "via its EinsumDense sublayers"),
    # ---------------------------------------------------------------------- fallback
    "RMSNormalization": (FALLBACK, "no rule yet (a direct term like LayerNormalization's "
                                   "would do)"),
    "PReLU": (FALLBACK, "no rule yet (alpha's per-example gradient is direct)"),
    "Attention": (FALLBACK, "no rule for its scale / concat-score weights"),
    "AdditiveAttention": (FALLBACK, "no rule for its scale weight"),
    "ReversibleEmbedding": (FALLBACK, "overrides Embedding.call (reverse projection with "
                                      "the same table)"),
    "RNN": (FALLBACK, "a generic cell runs inside Keras' loop, which captures cannot see "
                      "into"),
    "LSTMCell": (FALLBACK, "inside a generic RNN (LSTM has a rule)"),
    "GRUCell": (FALLBACK, "inside a generic RNN (GRU has a rule)"),
    "SimpleRNNCell": (FALLBACK, "inside a generic RNN (SimpleRNN has a rule)"),
    "StackedRNNCells": (FALLBACK, "inside a generic RNN"),
    "ConvLSTM1D": (FALLBACK, "recurrent convolution: no rule"),
    "ConvLSTM2D": (FALLBACK, "recurrent convolution: no rule"),
    "ConvLSTM3D": (FALLBACK, "recurrent convolution: no rule"),
    "TimeDistributed": (FALLBACK, "folds time into the batch axis (no per-example "
                                  "structure for a rule)"),
    "SpectralNormalization": (FALLBACK, "a wrapper that re-normalises and assigns the "
                                        "kernel in its call (from weights only)"),
    "STFTSpectrogram": (FALLBACK, "no rule (its kernels are trainable by default)"),
    "TFSMLayer": (FALLBACK, "a reloaded SavedModel function (trainable=True)"),
    "Layer": (FALLBACK, "custom layers: add a rule with tf_dp.register_ghost_rule "
                        "(docs/extending.md)"),
    # ----------------------------------------------------------------------- refused
    "BatchNormalization": (REFUSED, "trainable batch statistics mix examples; freeze it or "
                                    "use GroupNormalization / LayerNormalization"),
    # ------------------------------------------------------------- not applicable
    "FlaxLayer": (NOT_APPLICABLE, "JAX backend only"),
    "JaxLayer": (NOT_APPLICABLE, "JAX backend only"),
    "TorchModuleWrapper": (NOT_APPLICABLE, "PyTorch backend only"),
    "Wrapper": (NOT_APPLICABLE, "abstract base of Bidirectional, TimeDistributed, "
                                "SpectralNormalization"),
}

# tf_dp's own layers: their rule is a ``ghost_call`` method.
TF_DP_CLASSIFICATION = {
    "ReparamDense": (GHOST, "tf_dp.layers.reparam_dense"),
    "ReparamConv2D": (GHOST, "tf_dp.layers.reparam_conv2d"),
    "ReparamEinsumDense": (GHOST, "tf_dp.layers.reparam_einsum_dense"),
}

# Layers with weights that are all non-trainable state (lookup tables, statistics).
_NON_TRAINABLE_STATE = {
    "IntegerLookup": "vocabulary table",
    "StringLookup": "vocabulary table",
    "Normalization": "adapted mean and variance",
}
# Containers of other layers, with no weights of their own.
_CONTAINERS = {
    "Pipeline": "its layers are classified on their own",
    "TextVectorization": ("a StringLookup inside; refused with `output_sequence_length=None`, "
                          "which pads each batch to its longest text"),
    "RandAugment": "augmentation layers inside",
    "AugMix": "augmentation layers inside",
    "Lambda": "a function: cannot create weights",
}


def _keras_layer_classes():
    """{class name: class} of every layer class ``keras.layers`` exports (aliases once)."""
    names = {}
    for name in sorted(dir(L)):
        obj = getattr(L, name)
        if inspect.isclass(obj) and issubclass(obj, L.Layer):
            # The class's own name when exported under it, else its first alias
            # (GroupQueryAttention is class GroupedQueryAttention).
            if obj not in names or name == obj.__name__:
                names[obj] = name
    return {name: cls for cls, name in names.items()}


def _declares_weights(cls):
    """Whether a class (or a Keras base between it and ``Layer``) creates weights itself."""
    base = set(inspect.getmro(L.Layer))
    for k in inspect.getmro(cls):
        if k in base or not k.__module__.startswith("keras"):
            continue
        try:
            src = inspect.getsource(k)
        except (OSError, TypeError):
            continue
        if "add_weight" in src or "add_variable" in src or "Variable(" in src:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _classification():
    """Every class: CLASSIFICATION, tf_dp's layers and the weightless Keras classes (by
    their source)."""
    out = {**CLASSIFICATION, **TF_DP_CLASSIFICATION}
    for name, cls in _keras_layer_classes().items():
        if name in out:
            continue
        if name in _NON_TRAINABLE_STATE:
            out[name] = (NO_WEIGHTS, "non-trainable " + _NON_TRAINABLE_STATE[name])
        elif name in _CONTAINERS:
            out[name] = (NO_WEIGHTS, _CONTAINERS[name])
        elif not _declares_weights(cls):
            out[name] = (NO_WEIGHTS, "")
    return out


def test_every_keras_layer_is_classified():
    classes = _keras_layer_classes()
    table = _classification()
    missing = sorted(set(classes) - set(table))
    assert not missing, (
        f"Keras layer classes that create weights but are not classified: {missing}. Add "
        "each to CLASSIFICATION (ghost with a CASES entry, fallback with a reason, refused) "
        "and to the table in docs/extending.md.")
    stale = sorted(set(CLASSIFICATION) - set(classes))
    assert not stale, f"CLASSIFICATION names classes keras.layers does not export: {stale}"
    # Everything with trainable weights has a brute-force case.
    tested = {name for c in CASES for name in (c.cls, *c.also)}
    for name, (kind, _) in table.items():
        if kind in (GHOST, FALLBACK, REFUSED):
            assert name in tested, f"{name} ({kind}) has no case in CASES"


# ---------------------------------------------------------------------------------- cases


class Case:
    """One model exercising ``cls`` (and the classes in ``also``): ``build() -> model``;
    ``x``: a shape (float inputs) or an array; ``carriers``: privatize
    ``carrier_for(model).privatized`` (RGP layers)."""

    def __init__(self, cls, name, build, x, carriers=False, float64=True, xfail=None,
                 also=()):
        self.cls, self.name, self.build, self.x = cls, name, build, x
        self.carriers, self.float64, self.xfail = carriers, float64, xfail
        self.also = tuple(also)

    @property
    def kind(self):
        return _classification()[self.cls][0]

    @property
    def id(self):
        return f"{self.cls}-{self.name}"


def _head(*layers, inp, dtype=None):
    """``Input -> layers -> Flatten -> Dense(2)``."""
    return keras.Sequential([keras.Input(inp, dtype=dtype), *layers, L.Flatten(), L.Dense(2)])


def _self_attention(layer_fn, inp=(4, 6)):
    def build():
        i = keras.Input(inp)
        return keras.Model(i, L.Dense(2)(L.Flatten()(layer_fn()(i, i))))
    return build


def _attention(layer_fn, inp=(4, 6)):
    def build():
        i = keras.Input(inp)
        return keras.Model(i, L.Dense(2)(L.Flatten()(layer_fn()([i, i]))))
    return build


def _reversible_embedding():
    i = keras.Input((5,), dtype="int32")
    table = L.ReversibleEmbedding(7, 4)
    logits = table(L.Dense(4, activation="tanh")(table(i)), reverse=True)
    return keras.Model(i, L.Dense(2)(L.Flatten()(logits)))


def _spectral_normalization():
    model = _head(L.SpectralNormalization(L.Dense(3, activation="tanh")), inp=(6,))
    # Its training call re-normalises the kernel by one power iteration and assigns it, so
    # every call changes the weights: start from the iteration's fixed point, where the
    # reference's calls and the private step's see the same kernel.
    x = np.random.default_rng(5).normal(size=(2, 6))
    for _ in range(40):  # converged to float64 rounding after ~27
        model(x, training=True)
    return model


def _tfsm_layer():
    inner = keras.Sequential([keras.Input((4, 3)), L.Dense(3, activation="tanh")])
    path = os.path.join(tempfile.mkdtemp(), "saved")
    inner.export(path, verbose=False)
    i = keras.Input((4, 3))
    out = L.TFSMLayer(path, call_endpoint="serve", trainable=True)(i)
    return keras.Model(i, L.Dense(2)(L.Flatten()(out)))


class _Scale(L.Layer):
    """A custom layer with no rule."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[-1:], initializer="random_normal")

    def call(self, x):
        return x * self.w


_IDS = np.array([[1, 2, 2, 0, 0], [3, 4, 5, 6, 0], [1, 1, 1, 1, 1]], dtype="int32")

CASES = [
    # ghost ------------------------------------------------------------------------------
    Case("Dense", "sequence", lambda: _head(L.Dense(3, activation="tanh"), inp=(4, 5)),
         (4, 5)),
    Case("EinsumDense", "heads", lambda: _head(
        L.EinsumDense("abc,cde->abde", (4, 2, 3), bias_axes="de"), inp=(4, 5)), (4, 5)),
    Case("EinsumDense", "not_matmul_form", lambda: _head(
        L.EinsumDense("abc,cd->ad", (3,), bias_axes="d"), inp=(4, 5)), (4, 5)),
    Case("EinsumDense", "kernel_axes_permuted", lambda: _head(
        L.EinsumDense("abc,ecd->abde", (4, 3, 2), bias_axes="e"), inp=(4, 5)), (4, 5)),
    Case("Embedding", "repeated_ids", lambda: _head(L.Embedding(8, 3), inp=(5,),
                                                    dtype="int32"), _IDS),
    Case("Conv1D", "causal_dilated", lambda: _head(
        L.Conv1D(3, 3, padding="causal", dilation_rate=2, activation="tanh"), inp=(7, 2)),
        (7, 2)),
    Case("Conv2D", "same_strided", lambda: _head(
        L.Conv2D(3, 3, strides=2, padding="same"), inp=(5, 5, 2)), (5, 5, 2)),
    Case("Conv3D", "valid", lambda: _head(L.Conv3D(2, 2, activation="tanh"), inp=(3, 4, 3, 2)),
         (3, 4, 3, 2)),
    Case("Conv3D", "same_strided", lambda: _head(
        L.Conv3D(2, (2, 3, 2), strides=(2, 1, 2), padding="same"), inp=(4, 3, 4, 2)),
        (4, 3, 4, 2)),
    Case("Conv3D", "dilated", lambda: _head(L.Conv3D(2, 2, dilation_rate=(2, 1, 2)),
                                            inp=(4, 3, 4, 2)), (4, 3, 4, 2)),
    Case("DepthwiseConv1D", "same_multiplier", lambda: _head(
        L.DepthwiseConv1D(3, depth_multiplier=2, padding="same", activation="tanh"),
        inp=(6, 3)), (6, 3)),
    Case("DepthwiseConv1D", "channels_first_dilated", lambda: _head(
        L.DepthwiseConv1D(2, dilation_rate=2, data_format="channels_first"), inp=(3, 6)),
        (3, 6)),
    Case("DepthwiseConv2D", "valid_multiplier", lambda: _head(
        L.DepthwiseConv2D(3, depth_multiplier=2), inp=(5, 4, 3)), (5, 4, 3)),
    Case("DepthwiseConv2D", "same_strided_dilated", lambda: _head(
        L.DepthwiseConv2D(2, strides=2, dilation_rate=2, padding="same"), inp=(6, 5, 2)),
        (6, 5, 2)),
    Case("SeparableConv1D", "same", lambda: _head(
        L.SeparableConv1D(3, 3, padding="same", depth_multiplier=2), inp=(6, 2)), (6, 2)),
    Case("SeparableConv2D", "strided", lambda: _head(
        L.SeparableConv2D(3, 2, strides=2, activation="tanh"), inp=(5, 5, 2)), (5, 5, 2)),
    Case("Conv1DTranspose", "strided", lambda: _head(L.Conv1DTranspose(3, 3, strides=2),
                                                     inp=(4, 2)), (4, 2)),
    Case("Conv2DTranspose", "same_output_padding", lambda: _head(
        L.Conv2DTranspose(2, 3, strides=2, padding="same", output_padding=(1, 0)),
        inp=(3, 3, 2)), (3, 3, 2)),
    Case("Conv2DTranspose", "valid", lambda: _head(
        L.Conv2DTranspose(2, (3, 2), activation="tanh"), inp=(3, 3, 2)), (3, 3, 2)),
    Case("Conv3DTranspose", "same_strided", lambda: _head(
        L.Conv3DTranspose(2, 2, strides=(1, 2, 2), padding="same"), inp=(2, 2, 3, 2)),
        (2, 2, 3, 2)),
    Case("LayerNormalization", "last_axis", lambda: _head(L.Dense(4), L.LayerNormalization(),
                                                          inp=(3, 5)), (3, 5)),
    Case("GroupNormalization", "conv", lambda: _head(
        L.Conv2D(4, 2), L.GroupNormalization(groups=2), inp=(4, 4, 2)), (4, 4, 2)),
    Case("LSTM", "masked", lambda: _head(L.Embedding(8, 3, mask_zero=True), L.LSTM(3),
                                         inp=(5,), dtype="int32"), _IDS),
    Case("GRU", "reset_after", lambda: _head(L.GRU(3, return_sequences=True), inp=(4, 3)),
         (4, 3)),
    Case("GRU", "reset_before", lambda: _head(L.GRU(3, reset_after=False), inp=(4, 3)),
         (4, 3)),
    Case("SimpleRNN", "masked", lambda: _head(L.Embedding(8, 3, mask_zero=True),
                                              L.SimpleRNN(3), inp=(5,), dtype="int32"), _IDS),
    Case("SimpleRNN", "backwards_sequences", lambda: _head(
        L.SimpleRNN(3, go_backwards=True, return_sequences=True, activation="relu"),
        inp=(4, 3)), (4, 3)),
    Case("Bidirectional", "lstm", lambda: _head(
        L.Bidirectional(L.LSTM(3, return_sequences=True)), inp=(4, 3)), (4, 3)),
    Case("MultiHeadAttention", "self", _self_attention(lambda: L.MultiHeadAttention(2, 3)),
         (4, 6)),
    Case("GroupQueryAttention", "self", _self_attention(
        lambda: L.GroupQueryAttention(3, 2, 1)), (4, 6)),
    Case("ReparamDense", "lsg", lambda: _head(R.ReparamDense(4, rank=2, sparsity=0.5),
                                              inp=(3, 5)), (3, 5), carriers=True),
    Case("ReparamConv2D", "rgp", lambda: _head(R.ReparamConv2D(3, 2, rank=2), inp=(4, 4, 2)),
         (4, 4, 2), carriers=True),
    Case("ReparamEinsumDense", "heads_lsg", lambda: _head(
        R.ReparamEinsumDense("abc,cde->abde", (3, 2, 3), bias_axes="de", rank=2,
                             sparsity=0.5), inp=(3, 5)), (3, 5), carriers=True),
    Case("ReparamEinsumDense", "output_projection", lambda: _head(
        L.Reshape((3, 2, 3)), R.ReparamEinsumDense("abcd,cde->abe", (3, 4), bias_axes="e",
                                                   rank=2), inp=(3, 6)), (3, 6),
        carriers=True),
    Case("ReparamEinsumDense", "kernel_axes_permuted", lambda: _head(
        R.ReparamEinsumDense("abc,ecd->abde", (3, 3, 2), rank=2), inp=(3, 5)), (3, 5),
        carriers=True),
    # fallback ---------------------------------------------------------------------------
    Case("RMSNormalization", "last_axis", lambda: _head(L.RMSNormalization(), inp=(3, 4)),
         (3, 4)),
    Case("PReLU", "elementwise", lambda: _head(L.PReLU(), inp=(3, 4)), (3, 4)),
    Case("Attention", "scale_concat", _attention(
        lambda: L.Attention(use_scale=True, score_mode="concat")), (4, 6)),
    Case("AdditiveAttention", "scale", _attention(L.AdditiveAttention), (4, 6)),
    Case("ReversibleEmbedding", "tied", _reversible_embedding, _IDS),
    Case("RNN", "lstm_cell", lambda: _head(L.RNN(L.LSTMCell(2), return_sequences=True),
                                           inp=(3, 2)), (3, 2), also=["LSTMCell"]),
    Case("StackedRNNCells", "gru_simple_rnn_cells", lambda: _head(
        L.RNN(L.StackedRNNCells([L.GRUCell(2), L.SimpleRNNCell(2)])), inp=(3, 2)), (3, 2),
        also=["RNN", "GRUCell", "SimpleRNNCell"]),
    Case("ConvLSTM1D", "valid", lambda: _head(L.ConvLSTM1D(2, 2), inp=(2, 4, 2)), (2, 4, 2)),
    Case("ConvLSTM2D", "valid", lambda: _head(L.ConvLSTM2D(2, 2), inp=(2, 3, 3, 1)),
         (2, 3, 3, 1)),
    Case("ConvLSTM3D", "valid", lambda: _head(L.ConvLSTM3D(1, 2), inp=(2, 2, 3, 2, 1)),
         (2, 2, 3, 2, 1)),
    Case("TimeDistributed", "dense", lambda: _head(L.TimeDistributed(L.Dense(3)),
                                                   inp=(3, 4)), (3, 4)),
    Case("SpectralNormalization", "dense_at_fixed_point", _spectral_normalization, (6,)),
    Case("STFTSpectrogram", "trainable", lambda: _head(
        L.STFTSpectrogram(mode="log", frame_length=4, frame_step=2, fft_length=4),
        inp=(8, 1)), (8, 1)),
    Case("TFSMLayer", "trainable", _tfsm_layer, (4, 3), float64=False),
    Case("Layer", "custom_scale", lambda: _head(_Scale(), inp=(3, 4)), (3, 4)),
    # refused ----------------------------------------------------------------------------
    Case("BatchNormalization", "trainable", lambda: _head(L.BatchNormalization(), inp=(4,)),
         (4,)),
]

_LAYER_CLASSES = {**_keras_layer_classes(), "ReparamDense": R.ReparamDense,
                  "ReparamConv2D": R.ReparamConv2D, "ReparamEinsumDense": R.ReparamEinsumDense}


_Precision = ref.Precision


def _make(case, dtype):
    keras.utils.set_random_seed(0)
    with _Precision(dtype):
        model = case.build()
    rng = np.random.default_rng(1)
    if isinstance(case.x, tuple):
        x = rng.normal(size=(3, *case.x)).astype(dtype)
    else:
        x = case.x
    y = rng.normal(size=(len(x), 2)).astype(dtype)
    sample_weight = np.array([1.0, 0.5, 2.0], dtype=dtype)[:len(x)]
    variables = None
    if case.carriers:
        plan = carrier_for(model)
        plan.begin_step()  # fresh carriers, as at the start of a training step
        variables = plan.privatized
    return model, x, y, sample_weight, variables


def _params():
    out = []
    for case in CASES:
        for dtype in ("float64", "float32"):
            if (dtype == "float64" and not case.float64) or (
                    dtype == "float32" and case.kind != GHOST and case.float64):
                continue
            marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
            out.append(pytest.param(case, dtype, id=f"{case.id}-{dtype}", marks=marks))
    return out


_assert_matches = ref.assert_clipped_sum_matches


def _check_rule_modules(model, case):
    """The documented rule is the one ``rule_for`` finds for the class's instances."""
    where = _classification()[case.cls][1]
    if where.startswith("via "):
        return
    cls = _LAYER_CLASSES[case.cls]
    found = [layer for layer in ghost.capturable_layers(model) if type(layer) is cls]
    assert found, f"no {case.cls} reachable by capture"
    for layer in found:
        assert registry.rule_for(layer).__module__ == where


@pytest.mark.parametrize("case,dtype", _params())
def test_layer_matches_brute_force(case, dtype):
    model, x, y, sample_weight, variables = _make(case, dtype)
    loss_fn = build_per_example_loss("mse")
    if case.kind == REFUSED:
        with pytest.raises(ValueError, match=case.cls):
            clipped_sum(model, x, y, sample_weight, loss_fn, 1.0, variables=variables)
        return
    per = ref.per_example_gradients(model, loss_fn, x, y, sample_weight, variables)
    variables = list(model.trainable_variables if variables is None else variables)
    norms = ref.per_example_norms(per)
    assert np.all(norms > 0)
    # A clip between the norms: some examples clipped, others not. Rounded to float32:
    # clip_factors takes a Python float through float32 (tf.cast), which a float64
    # reference would see as a relative error of up to 6e-8 in the clipped examples' sums.
    clip = float(np.float32(np.median(norms)))
    w = ref.clip_weights(norms, clip)
    sums = [np.tensordot(w, g, axes=1) for g in per]
    if case.kind == GHOST:
        _check_rule_modules(model, case)
        res = clipped_sum(model, x, y, sample_weight, loss_fn, clip, variables=variables,
                          norm_strategy="ghost")
    else:
        with pytest.raises(ValueError, match="no ghost-norm"):
            clipped_sum(model, x, y, sample_weight, loss_fn, clip, variables=variables,
                        norm_strategy="ghost")
        res = clipped_sum(model, x, y, sample_weight, loss_fn, clip, variables=variables,
                          norm_strategy="auto")
    _assert_matches(res, norms, sums, variables, dtype)


# ------------------------------------------------------------------------------ the docs


def coverage_table():
    """The markdown table of docs/extending.md, from ``CLASSIFICATION`` (with trainable
    weights: ghost, fallback, refused; then the rest in one line each)."""
    table = _classification()
    rows = ["| Layer | Per-example gradients | Where / why |", "|---|---|---|"]
    order = {GHOST: 0, FALLBACK: 1, REFUSED: 2}
    for name in sorted((n for n, (k, _) in table.items() if k in order),
                       key=lambda n: (order[table[n][0]], n)):
        kind, where = table[name]
        if kind == GHOST and not where.startswith("via"):
            method = " (`ghost_call`)" if where.startswith("tf_dp.layers.") else ""
            where = "`" + where.replace(".", "/") + ".py`" + method
        rows.append(f"| {name} | {kind} | {where} |")
    lines = ["\n".join(rows), ""]
    for kind in (NO_WEIGHTS, NOT_APPLICABLE):
        names = sorted(n for n, (k, _) in table.items() if k == kind)
        notes = [f"{n} ({table[n][1]})" if table[n][1] else n for n in names]
        lines.append(f"**{kind.capitalize()}:** " + ", ".join(notes) + ".")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def test_docs_table_matches():
    path = os.path.join(_ROOT, "docs", "extending.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert coverage_table() in text, (
        "docs/extending.md's coverage table differs from CLASSIFICATION; regenerate it with "
        "`python tests/core/ghost_coverage_test.py --print-table`.")


if __name__ == "__main__" and "--print-table" in sys.argv:
    print(coverage_table(), end="")
    sys.exit(0)

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
