"""Checks that a model treats the examples of a batch independently, before private training.

Per-example clipping bounds one example's influence on the clipped sum by C only if example
i's gradient is a function of example i alone. A layer that mixes the examples of a batch
(batch statistics, ``x - reduce_mean(x, axis=0)``, ``tf.roll`` over the batch axis, a
division by the batch size) lets one example move every other example's gradient: removing
it changes the clipped sum by up to about B * C, not C, and the reported epsilon is void.

A list of offending layer classes cannot be complete (any custom layer can mix), so
:func:`check_per_example_independence` tests the property itself on a few rows of a real
batch, eagerly and in training mode (the mode of the private step):

    full      rows r_0 .. r_{n-1}                          (reference)
    content   first half kept at its positions, the rest replaced by copies of kept rows
              (and the mirror image): same batch shape, other examples changed
    removal   the first half alone: the batch size changes

and refuses the model if the outputs, per-example losses or the gradient of a random
combination of the kept rows' losses differ. Random layers are replayed (their Keras seed
generators are reset before every pass), so every pass sees the same masks; stateless
Keras random ops draw the first k rows of a batch identically for any batch size, so the
removal test compares like with like too.

Preprocessing layers fitted with ``adapt`` (:func:`adapted_preprocessing_layers`) hold
statistics of whatever data they were adapted on; on the private training data these are
released with the model outside the privacy guarantee, so they get a warning
(:func:`warn_adapted_layers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

DEFAULT_NUM_ROWS = 8
# Relative tolerance, norm-wise: batched kernels of different batch sizes differ by ~1e-7
# relative per op (~1e-6 through LSTMs); mixing layers move outputs by far more.
DEFAULT_RTOL = 1e-4

_WHY = (
    "One example then moves every other example's gradient, so its influence on the clipped "
    "sum is not bounded by the clipping norm (removing it can change the sum by about "
    "batch_size * l2_norm_clip) and the reported epsilon does not hold.")
_WHAT_TO_DO = (
    "Make every layer per-example: normalise with keras.layers.LayerNormalization or "
    "GroupNormalization instead of batch statistics, freeze a layer that mixes only in "
    "training mode (layer.trainable = False), and compute batch-level statistics outside "
    "the model (on public data).")


# ------------------------------------------------------------------ the independence check


def check_per_example_independence(model: keras.Model, x, y, sample_weight,
                                   per_example_loss: Callable, variables: Optional[Sequence] = None,
                                   num_rows: int = DEFAULT_NUM_ROWS,
                                   rtol: float = DEFAULT_RTOL) -> None:
    """Raises ``ValueError`` if an example's loss or gradient depends on the other examples.

    Runs eagerly, with ``training=True``, on up to ``num_rows`` rows of a real batch (rows of
    sample weight 0, i.e. padding, are skipped). The model's state (normalisation
    statistics, seed generators) is restored afterwards. Known offenders
    (``BatchNormalization``) are refused first with their own message.

    Args:
      model: the Keras model (built or not; an unbuilt model is built by the check).
      x, y, sample_weight: one batch, as given to the private step (any nesting).
      per_example_loss: ``fn(y_true, y_pred, sample_weight) -> (B,)``.
      variables: the variables whose per-example gradients are clipped (default: the
        model's trainable variables).
      num_rows: rows of the batch to use (at least 2 are needed; fewer: nothing is checked).
      rtol: relative tolerance, norm-wise, of every comparison.

    Raises:
      ValueError: naming the layer (when it can be located) whose output for one example
        changes with the other examples.
    """
    from tf_dp.core import private_step  # the known offenders keep their specific message

    private_step._check_no_cross_example_layers(model)
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 2:
        raise ValueError(f"`num_rows` must be an integer >= 2, got {num_rows!r}.")
    if not rtol > 0:
        raise ValueError(f"`rtol` must be > 0, got {rtol!r}.")
    probe = _probe_rows(x, y, sample_weight, num_rows)
    if probe is None:
        return
    xs, ys = probe
    n = _num_rows(xs)
    try:
        if not _fully_built(model):
            model(xs, training=False)  # create the variables before their state is saved
    except Exception as err:  # noqa: BLE001 - the private step will report it properly
        _warn_unchecked(f"the model could not be called on {n} rows ({err})")
        return
    variables = list(model.trainable_variables if variables is None else variables)
    with _preserved_state(model) as replay:
        checker = _Checker(model, per_example_loss, variables, replay, rtol)
        checker.run(xs, ys, n)


@dataclasses.dataclass
class _Pass:
    outputs: list  # flat model outputs
    losses: tf.Tensor  # (B,)
    grads: list  # per coefficient vector: list of gradients over variables


@dataclasses.dataclass
class _Comparison:
    """A batch built from the reference rows, and which of its rows to compare."""

    description: str
    index: list  # reference row of each row of this batch
    rows: list  # rows of this batch compared ...
    ref_rows: list  # ... with these rows of the reference batch
    stochastic_off: bool = False


class _Checker:
    def __init__(self, model, per_example_loss, variables, replay, rtol):
        self.model = model
        self.loss = per_example_loss
        self.variables = variables
        self.handles = [v.value if hasattr(v, "value") else v for v in variables]
        self.replay = replay
        self.rtol = rtol

    def run(self, xs, ys, n):
        h = n // 2
        coef = np.random.default_rng(0x1D).uniform(0.5, 1.5, size=n)
        first, second = list(range(h)), list(range(h, n))
        comparisons = [
            _Comparison("when the other examples of the batch were replaced",
                        first + [first[i % h] for i in range(n - h)], first, first),
            _Comparison("when the other examples of the batch were replaced",
                        [second[i % (n - h)] for i in range(h)] + second, second, second),
            _Comparison(f"when the batch shrank from {n} to {h} examples (a layer that "
                        "depends on the batch size, e.g. divides by it, mixes examples too)",
                        first, first, first),
        ]
        try:
            ref = self._pass(xs, ys, list(range(n)), coef, [first, second])
            again = self._pass(xs, ys, list(range(n)), coef, [])
        except Exception as err:  # noqa: BLE001
            _warn_unchecked(f"the model could not be called on {n} rows ({err})")
            return
        if self._differs(ref, again, list(range(n)), list(range(n)), None) is not None:
            _warn_unchecked(
                "the forward pass is random in a way that cannot be replayed (random ops "
                "outside Keras seed generators)")
            return
        for comp in comparisons:
            diff = self._compare(xs, ys, ref, comp, coef, first, second)
            if diff is None:
                continue
            if comp.index == first and _has_stochastic_layers(self.model):
                # The removal test assumes random layers draw a batch's first rows alike
                # for any batch size (true of Keras' stateless ops); confirm without them.
                comp = dataclasses.replace(comp, stochastic_off=True)
                with _stochastic_layers_off(self.model):
                    ref_off = self._pass(xs, ys, list(range(n)), coef, [first, second])
                    diff = self._compare(xs, ys, ref_off, comp, coef, first, second)
                if diff is None:
                    continue
            raise ValueError(self._message(xs, ys, comp, diff, n))

    def _compare(self, xs, ys, ref, comp, coef, first, second):
        try:
            got = self._pass(_take(xs, comp.index), _take(ys, comp.index), comp.rows,
                             coef[comp.index], [comp.rows])
        except Exception as err:  # noqa: BLE001
            if comp.index == first:  # e.g. a model that needs a fixed batch size
                _warn_unchecked(f"the model could not be called on {len(first)} rows ({err}); "
                                "only batches of the full probe size were compared",
                                stacklevel=5)
                return None
            raise
        ref_grads = ref.grads[0 if comp.ref_rows == first else 1]
        return self._differs(ref, got, comp.ref_rows, comp.rows, (ref_grads, got.grads[0]))

    def _pass(self, xs, ys, _rows, coef, coef_rows):
        _replay(self.replay)
        with tf.GradientTape(persistent=len(coef_rows) > 1) as tape:
            tape.watch(self.handles)
            y_pred = self.model(xs, training=True)
            losses = self.loss(ys, y_pred, None)
            objectives = []
            for rows in coef_rows:
                c = np.zeros(len(coef))
                c[rows] = coef[rows]
                objectives.append(tf.reduce_sum(losses * tf.constant(c, losses.dtype)))
        grads = [tape.gradient(o, self.handles, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                 for o in objectives]
        del tape
        return _Pass(tf.nest.flatten(y_pred), losses, grads)

    def _differs(self, ref, got, ref_rows, rows, grads):
        """What differs between two passes at corresponding rows, or None."""
        for a, b in zip(ref.outputs, got.outputs):
            if not _rows_close(a, b, ref_rows, rows, self.rtol):
                return "output"
        if not _rows_close(ref.losses, got.losses, ref_rows, rows, self.rtol):
            return "loss"
        if grads is not None and not _grads_close(grads[0], grads[1], self.rtol):
            return "gradient"
        return None

    def _message(self, xs, ys, comp, diff, n):
        where = self._locate(xs, ys, comp) if diff == "output" else None
        subject = {"output": "the model's output", "loss": "the per-example loss",
                   "gradient": "the gradient of the per-example loss"}[diff]
        if where is None:
            if diff == "loss":
                where = "The loss function"
            elif diff == "gradient":
                where = ("The model's gradient (its forward values do not mix, so a custom "
                         "gradient or stop_gradient does)")
            else:
                where = "The model"
        extra = ""
        layer = getattr(self, "_culprit", None)
        if isinstance(layer, keras.layers.BatchNormalization):
            extra = (" It is a BatchNormalization layer in training mode: its batch "
                     "statistics mix examples; freeze it (layer.trainable = False) or use "
                     "GroupNormalization/LayerNormalization.")
        return (f"tf_dp: {where} mixes the examples of a batch: {subject} for one example "
                f"changed {comp.description} (checked on {n} rows of the first batch, "
                f"training=True).{extra} {_WHY} {_WHAT_TO_DO}")

    def _locate(self, xs, ys, comp):
        """The first layer call whose inputs agree at the compared rows and outputs do not."""
        self._culprit = None
        n = _num_rows(xs)
        ctx = _stochastic_layers_off(self.model) if comp.stochastic_off else contextlib.nullcontext()
        try:
            with ctx:
                with _recorded_calls(self.model) as ref_calls:
                    self._pass(xs, ys, None, np.ones(n), [])
                with _recorded_calls(self.model) as got_calls:
                    self._pass(_take(xs, comp.index), _take(ys, comp.index), None,
                               np.ones(len(comp.index)), [])
        except Exception:  # noqa: BLE001 - locating is a courtesy; the refusal stands
            return None
        if len(ref_calls) != len(got_calls):
            return None
        n_got = len(comp.index)
        for (layer, ins_a, outs_a), (_, ins_b, outs_b) in zip(ref_calls, got_calls):
            def clean(ts_a, ts_b):
                return all(_rows_close(a, b, comp.ref_rows, comp.rows, self.rtol, n, n_got)
                           for a, b in zip(ts_a, ts_b))

            if clean(ins_a, ins_b) and not clean(outs_a, outs_b):
                self._culprit = layer
                kind = type(layer).__name__
                if _sublayers(layer):
                    return (f"The call of {kind} {layer.name!r} itself (outside its "
                            "sublayers)")
                return f"Layer {layer.name!r} ({kind})"
        return None


# ------------------------------------------------------------------ probe rows, comparisons


def _probe_rows(x, y, sample_weight, num_rows):
    """Up to ``num_rows`` rows of the batch with positive sample weight, or None if < 2."""
    n = _num_rows(x)
    if n is None:
        return None
    rows = np.arange(n)
    if sample_weight is not None:
        w = np.asarray(tf.reshape(tf.convert_to_tensor(sample_weight), [n, -1])[:, 0])
        rows = rows[w > 0]
    rows = list(rows[:num_rows])
    if len(rows) < 2:
        return None
    return _take(x, rows), _take(y, rows)


def _num_rows(x):
    leaves = [t for t in tf.nest.flatten(x) if t is not None]
    if not leaves:
        return None
    leaf = leaves[0]
    if isinstance(leaf, tf.RaggedTensor):
        return int(leaf.nrows())
    return int(tf.shape(leaf)[0]) if tf.is_tensor(leaf) else len(leaf)


def _take(structure, index):
    index = np.asarray(index, dtype=np.int64)
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.gather(t if tf.is_tensor(t) else np.asarray(t),
                                                   index), structure)


def _as_rows(t, rows, batch):
    """``t[rows]`` as float64, or None if ``t`` has no batch axis of size ``batch``."""
    if isinstance(t, tf.RaggedTensor):
        t = t.to_tensor()
    if not tf.is_tensor(t) or t.shape.rank is None or t.shape.rank == 0:
        return None
    if batch is not None and int(tf.shape(t)[0]) != batch:
        return None
    if t.dtype == tf.string or t.dtype == tf.bool:
        t = tf.cast(tf.strings.to_hash_bucket_fast(t, 2**31), tf.float64) \
            if t.dtype == tf.string else tf.cast(t, tf.float64)
    return tf.cast(tf.gather(t, rows), tf.float64)


def _rows_close(a, b, rows_a, rows_b, rtol, batch_a=None, batch_b=None):
    a, b = _as_rows(a, rows_a, batch_a), _as_rows(b, rows_b, batch_b)
    if a is None or b is None or a.shape != b.shape:
        return True  # nothing comparable
    return _close(float(tf.reduce_sum(tf.square(a - b))), float(tf.reduce_sum(tf.square(a))),
                  float(tf.reduce_sum(tf.square(b))), rtol)


def _close(diff_sq, a_sq, b_sq, rtol):
    scale = max(a_sq, b_sq)
    return diff_sq <= rtol ** 2 * scale + 1e-30


def _grads_close(ga, gb, rtol):
    diff_sq = a_sq = b_sq = 0.0
    for a, b in zip(ga, gb):
        a, b = _dense64(a), _dense64(b)
        diff_sq += float(tf.reduce_sum(tf.square(a - b)))
        a_sq += float(tf.reduce_sum(tf.square(a)))
        b_sq += float(tf.reduce_sum(tf.square(b)))
    return _close(diff_sq, a_sq, b_sq, rtol)


def _dense64(g):
    return tf.cast(tf.convert_to_tensor(g), tf.float64)


# ------------------------------------------------------------------ model state and randomness


def _fully_built(model):
    return model.built and all(layer.built for layer in
                               model._flatten_layers(include_self=False, recursive=True))


def _seed_generators(model):
    gens = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        gens.extend(getattr(layer, "_seed_generators", []) or [])
    try:  # unseeded keras.random calls draw from the global generator
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator

        glob = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    except ImportError:  # pragma: no cover - private Keras module moved
        glob = None
    if glob is not None:
        gens.append(glob)
    uniq, seen = [], set()
    for g in gens:
        if id(g) not in seen:
            seen.add(id(g))
            uniq.append(g)
    return uniq


@contextlib.contextmanager
def _preserved_state(model):
    """Yields the seed generators' saved states (for replay); restores all state at exit."""
    gens = _seed_generators(model)
    seeds = [tf.identity(g.state.value) for g in gens]
    state = [v for v in model.non_trainable_variables
             if not any(v is g.state for g in gens)]
    saved = [tf.identity(v.value) for v in state]
    try:
        yield gens, seeds
    finally:
        for v, s in zip(state, saved):
            v.assign(s)
        for g, s in zip(gens, seeds):
            g.state.assign(s)


def _replay(replay):
    gens, seeds = replay
    for g, s in zip(gens, seeds):
        g.state.assign(s)


def _stochastic_layers(model):
    out = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        own = getattr(layer, "_seed_generators", None)
        cell = getattr(layer, "cell", None)
        cells = [cell] + list(getattr(cell, "cells", []) or []) if cell is not None else []
        if own or any(getattr(c, "_seed_generators", None) for c in cells):
            out.append(layer)
    return out


def _has_stochastic_layers(model):
    return bool(_stochastic_layers(model))


@contextlib.contextmanager
def _patched_calls(layers, make):
    patched = []
    try:
        for layer in layers:
            original = layer.__dict__.get("call")
            layer.call = make(layer, layer.call)
            patched.append((layer, original))
        yield
    finally:
        for layer, original in reversed(patched):
            if original is None:
                del layer.call
            else:
                layer.call = original


def _stochastic_layers_off(model):
    """Random layers (and RNNs with dropout) run in inference mode; the rest in training."""
    def make(layer, bound):
        def call(*args, **kwargs):
            if "training" in kwargs:
                kwargs["training"] = False
            return bound(*args, **kwargs)
        return call

    return _patched_calls(_stochastic_layers(model), make)


@contextlib.contextmanager
def _recorded_calls(model):
    """Yields a list filled with (layer, flat inputs, flat outputs) per call, as calls end."""
    calls = []

    def make(layer, bound):
        def call(*args, **kwargs):
            out = bound(*args, **kwargs)
            calls.append((layer, tf.nest.flatten((args, kwargs)), tf.nest.flatten(out)))
            return out
        return call

    layers = list(model._flatten_layers(include_self=True, recursive=True))
    with _patched_calls(layers, make):
        yield calls


def _sublayers(layer):
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _warn_unchecked(reason, stacklevel=4):
    warnings.warn(f"tf_dp: could not check that the model treats examples independently: "
                  f"{reason}. A layer that mixes the examples of a batch would void the "
                  "privacy guarantee.", UserWarning, stacklevel=stacklevel)


# ------------------------------------------------------------------ adapted preprocessing


def adapted_preprocessing_layers(model) -> list:
    """Preprocessing layers of ``model`` (or the layer itself) whose state came from ``adapt``.

    Keras 3 marks no layer as adapted, so the state is inspected: a ``Normalization``
    without ``mean``/``variance`` arguments whose statistics moved from (0, 1); a
    ``TextVectorization`` / ``StringLookup`` / ``IntegerLookup`` without a ``vocabulary``
    argument that has a vocabulary; a ``Discretization`` with ``num_bins`` whose
    ``bin_boundaries`` were learned. Statistics passed in as constructor arguments (or set
    with ``set_vocabulary``) are not reported: their origin is the user's to know.
    """
    found = []
    inner_lookups = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, keras.layers.TextVectorization):
            inner_lookups.add(id(getattr(layer, "_lookup_layer", None)))
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if id(layer) not in inner_lookups and _is_adapted(layer):
            found.append(layer)
    return found


def _is_adapted(layer) -> bool:
    if isinstance(layer, keras.layers.Normalization):
        if layer.input_mean is not None or not layer.built:
            return False
        mean = getattr(layer, "adapt_mean", None)
        var = getattr(layer, "adapt_variance", None)
        if mean is None or var is None:
            return False
        return bool(np.any(np.asarray(mean) != 0) or np.any(np.asarray(var) != 1))
    if isinstance(layer, keras.layers.TextVectorization):
        return _lookup_adapted(getattr(layer, "_lookup_layer", None), layer)
    if isinstance(layer, (keras.layers.StringLookup, keras.layers.IntegerLookup)):
        return _lookup_adapted(layer, layer)
    if isinstance(layer, keras.layers.Discretization):
        return layer.num_bins is not None and layer.bin_boundaries is not None
    return False


def _lookup_adapted(lookup, owner) -> bool:
    if lookup is None or getattr(owner, "_has_input_vocabulary", False) \
            or getattr(lookup, "_has_input_vocabulary", False):
        return False
    counts = getattr(lookup, "token_counts", None)
    if counts is not None and int(counts.size()) > 0:
        return True
    # The counts may have been reset; a vocabulary beyond the special tokens is learned.
    try:
        vocab = lookup.get_vocabulary(include_special_tokens=False)
    except Exception:  # noqa: BLE001 - an uninitialised table has no vocabulary
        return False
    return len(vocab) > 0


def adapted_layers_warning(layers) -> str:
    """The warning text for ``layers`` (from :func:`adapted_preprocessing_layers`)."""
    names = ", ".join(f"{layer.name!r} ({type(layer).__name__})" for layer in layers)
    return (f"tf_dp: preprocessing layers {names} were fitted with adapt(). Their "
            "statistics (mean/variance, vocabulary, bin boundaries) come from the data they "
            "were adapted on and are released with the model OUTSIDE the privacy guarantee: "
            "the reported epsilon covers them only if that data was public (not the private "
            "training data) or the statistics were computed with differential privacy. "
            "Adapt on public data, pass fixed values (mean=/variance=, vocabulary=, "
            "bin_boundaries=), or use data-independent preprocessing (hashing).")


def warn_adapted_layers(model, stacklevel: int = 2) -> list:
    """Warns (``UserWarning``) once if ``model`` has adapted preprocessing layers.

    Returns the layers (empty: no warning).
    """
    layers = adapted_preprocessing_layers(model)
    if layers:
        warnings.warn(adapted_layers_warning(layers), UserWarning, stacklevel=stacklevel + 1)
    return layers
