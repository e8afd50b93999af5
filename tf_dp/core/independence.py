"""Checks that a model treats the examples of a batch independently, before private training.

Per-example clipping bounds one example's influence on the clipped sum by C only if example
i's gradient is a function of example i alone. A layer that mixes the examples of a batch
(batch statistics, ``x - reduce_mean(x, axis=0)``, ``tf.roll`` over the batch axis, a
division by the batch size) lets one example move every other example's gradient: removing
it changes the clipped sum by up to about B * C, not C, and the reported epsilon is void.

A list of offending layer classes cannot be complete (any custom layer can mix), so
:func:`check_per_example_independence` tests the property itself on a few rows (n <= 8) of
a real batch, in training mode (the mode of the private step), before training:

    reference  rows r_0 .. r_{n-1}
    content    the first half kept at its positions, the other rows replaced by copies of
               kept rows (and the mirror image): same batch shape, other examples changed
    removal    the first half alone: the batch size changes

and refuses the model if, at the kept rows, the outputs, the per-example losses or the
gradient of a random positive combination of their losses differ (norm-wise, relative
tolerance 1e-4; float noise between batch sizes is ~1e-7, mixing layers move them by
~1e-1). Random layers are replayed (their Keras seed generators are reset before every
pass), so all passes see the same masks; Keras' stateless random ops draw the first k rows
of a batch alike for any batch size, and where a layer's draws do not (the removal test
then differs), the removal test is repeated with the random layers in inference mode. On a
refusal the passes are repeated eagerly with every layer call recorded, and the first call
whose inputs agree at the kept rows while its outputs do not is named.

Not seen: mixing that only occurs at batch positions or sizes the probe does not produce,
or that is below the tolerance; random ops outside Keras seed generators make the passes
incomparable (the check then warns and lets training go on).

A per-example model can still break the ghost-norm rules, which take row k of a layer's
input and of its output gradient as example k's: a layer applied time-major (T == B) or to a
batch rolled, reversed, gathered or sorted along axis 0 and put back in order afterwards.
:func:`check_ghost_rows_are_examples` (run by :func:`check_before_private_training` when the
norms come from ghost rules) replaces sets of examples and requires, for every call of every
layer the rules capture, that only the replaced rows of its inputs and outputs move and that
row k of its output gradient carries example k's loss alone; a leading axis that is not the
batch's is probed again at its own length.

Preprocessing layers fitted with ``adapt`` (:func:`adapted_preprocessing_layers`) hold
statistics of whatever data they were adapted on; on the private training data these are
released with the model outside the privacy guarantee, so they get a warning
(:func:`warn_adapted_layers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _internals

DEFAULT_NUM_ROWS = 8
# Relative tolerance, norm-wise: batched kernels of different batch sizes differ by ~1e-7
# relative per op (~1e-6 through LSTMs); mixing layers move outputs by far more.
DEFAULT_RTOL = 1e-4
# Float16/bfloat16 compute (mixed precision) rounds at ~1e-3 / ~8e-3: compare more loosely.
_LOW_PRECISION_RTOL = 2e-2

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

    Call it outside any traced function, before the first private step. It runs the model
    with ``training=True`` on up to ``num_rows`` rows of a real batch (rows of sample weight
    0, i.e. padding, are skipped): five passes of at most ``num_rows`` rows through one
    ``tf.function`` traced for an unknown batch size (plus eager passes to name the layer
    when it refuses). The model's state (normalisation statistics, seed generators) is
    restored afterwards. Known offenders (``BatchNormalization``) are refused first with
    their own message.

    Args:
      model: the Keras model (built or not; an unbuilt model is built by the check).
      x, y, sample_weight: one batch, as given to the private step (any nesting).
      per_example_loss: ``fn(y_true, y_pred, sample_weight) -> (B,)``.
      variables: the variables whose per-example gradients are clipped (default: the
        model's trainable variables).
      num_rows: rows of the batch to use (at least 2 are needed; fewer: nothing is checked).
      rtol: relative tolerance, norm-wise, of every comparison (at least 2e-2 when a layer
        computes in float16 or bfloat16).

    Raises:
      ValueError: naming the layer (when it can be located) whose output for one example
        changes with the other examples.
    """
    from tf_dp.core import private_step  # the known offenders keep their specific message

    private_step.check_no_cross_example_layers(model)
    probe = _built_probe(model, x, y, sample_weight, num_rows, rtol, _warn_unchecked)
    if probe is None:
        return False
    xs, ys = probe
    n = _num_rows(xs)
    variables = list(model.trainable_variables if variables is None else variables)
    if _low_precision(model):
        rtol = max(rtol, _LOW_PRECISION_RTOL)
    with _preserved_state(model) as replay:
        # False if nothing could be compared (a warning says why): not checked.
        return _Checker(model, per_example_loss, variables, replay, rtol).run(xs, ys, n)


def check_before_private_training(model: keras.Model, x, y=None, sample_weight=None,
                                  per_example_loss: Callable = None,
                                  variables: Optional[Sequence] = None,
                                  norm_strategy=None) -> bool:
    """:func:`check_per_example_independence` on the first rows of training input ``x``, once
    per model architecture (its layers and their ``trainable`` flags), and, when the norms
    come from ghost rules, :func:`check_ghost_rows_are_examples` on the same rows. For a
    PoissonSampler (or a dataset made by one) the rows are the data's first rows, not a
    sampled batch.

    ``x`` is anything ``fit`` / ``train_on_batch`` accept: arrays or tensors (nested), a
    ``tf_dp.data.PoissonSampler``, a ``tf.data.Dataset`` of batches (its first batch is
    read), a ``keras.utils.PyDataset`` (its batch 0); a Python generator cannot be peeked
    at without consuming it, so it gets a warning instead.

    ``norm_strategy``: the strategy of the private step (default: the one of the model's
    compiled DP optimizer; if there is none, the ghost-row check runs). Every strategy but
    ``"vectorized"`` / ``"vmap"`` uses the ghost rules.

    Returns:
      True if a check ran (and passed), False if this architecture had already passed them
      or the input cannot be read ahead or has fewer than two rows to compare (then with a
      warning; the next call tries again).

    Raises:
      ValueError: as :func:`check_per_example_independence` and
        :func:`check_ghost_rows_are_examples`.
    """
    if per_example_loss is None:
        raise ValueError("`per_example_loss` is required.")
    signature = _architecture(model)
    _ATTEMPTED[model] = signature
    independent = _CHECKED.get(model) == signature
    rows_done = (_ROWS_CHECKED.get(model) == signature
                 or not _uses_ghost_rules(model, norm_strategy))
    if independent and rows_done:
        return False
    probe = _first_batch(x, y, sample_weight)
    if probe is None:
        _warn_unchecked(f"its input ({type(x).__name__}) cannot be read ahead without "
                        "consuming it; pass arrays, a PoissonSampler or a tf.data.Dataset",
                        stacklevel=3)
        return False
    # A sampler's dataset mapped after the sampler (masking, augmentation, a new input
    # structure): the sampler's raw rows may not fit the model. Then its own batches serve: a
    # few of them, concatenated (fresh Poisson draws; nothing is replayed).
    fallback = isinstance(x, tf.data.Dataset)
    sampled = []

    def attempt(check):
        with warnings.catch_warnings(record=fallback) as first_warnings:
            if fallback:
                warnings.simplefilter("always")
            ran = check(model, *probe, per_example_loss, variables=variables)
        if fallback and not ran:
            if not sampled:
                sampled.append(_sampled_rows(x))
            if sampled[0] is not None:
                return check(model, *sampled[0], per_example_loss, variables=variables)
        if fallback:
            for caught in first_warnings:
                warnings.warn(caught.message, caught.category, stacklevel=4)
        return ran

    ran = False
    if not independent:
        if not attempt(check_per_example_independence):
            # Fewer than 2 real rows (a small Poisson batch, batches of one), or the model
            # could not be called: nothing was compared, so the model is NOT marked as checked.
            _warn_unchecked("the check did not run (fewer than 2 rows with non-zero sample "
                            "weight to compare, or the model could not be called on them)",
                            stacklevel=3)
            return False
        _CHECKED[model] = signature
        ran = True
    if not rows_done and attempt(check_ghost_rows_are_examples):
        # Not marked when it could not compare (it warned): the next call tries again.
        _ROWS_CHECKED[model] = signature
        ran = True
    return ran


_CHECKED = weakref.WeakKeyDictionary()  # model -> architecture it last passed the check with
_ROWS_CHECKED = weakref.WeakKeyDictionary()  # the same for check_ghost_rows_are_examples
#: model -> the architecture check_before_private_training last ran for (passed, refused or,
#: with a warning, unable to compare)
_ATTEMPTED = weakref.WeakKeyDictionary()


def checks_passed(model) -> bool:
    """Whether ``model``'s current architecture passed the per-example check (and, where the
    norms come from ghost rules, the row check) — False when a check could not compare."""
    signature = _architecture(model)
    return _CHECKED.get(model) == signature and (
        _ROWS_CHECKED.get(model) == signature or not _uses_ghost_rules(model, None))


def checks_attempted(model) -> bool:
    """Whether :func:`check_before_private_training` ever ran for ``model``: a private step
    traced before that would train a model nobody looked at for layers that mix examples
    (fit and train_on_batch run it, again whenever the architecture changed; a traced
    custom loop must call it first). Any earlier run counts: an unbuilt model gains layers
    when it is built, after its check."""
    return model in _ATTEMPTED


def _architecture(model):
    return tuple((id(layer), layer.trainable)
                 for layer in _internals.all_layers(model))


def _first_batch(x, y, sample_weight, rows=4 * DEFAULT_NUM_ROWS):
    """(x, y, sample_weight) of at most ``rows`` rows of the first batch of ``x``, or None."""
    from tf_dp.data.poisson import PoissonSampler

    from tf_dp.data.poisson import sampler_of

    sampler = x if isinstance(x, PoissonSampler) else (
        sampler_of(x) if isinstance(x, tf.data.Dataset) else None)
    if sampler is not None:
        # The data's first rows, not its first Poisson batch (which may hold fewer than the
        # two rows the comparison needs).
        x, y, sample_weight = sampler.x, sampler.y, sampler.sample_weight
    elif isinstance(x, tf.data.Dataset):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(next(iter(x.take(1))))
    elif isinstance(x, keras.utils.PyDataset):
        batch = x[0]
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
            tuple(batch) if isinstance(batch, list) else batch)
    leaves = [t for t in tf.nest.flatten(x) if t is not None]
    if not leaves or not all(tf.is_tensor(t) or hasattr(t, "shape") for t in leaves):
        return None  # a generator or another one-pass iterable

    def head(t):
        if t is None:
            return None
        if hasattr(t, "iloc"):  # pandas
            return np.asarray(t.iloc[:rows])
        return t[:rows]

    return tuple(tf.nest.map_structure(head, part) for part in (x, y, sample_weight))


def _sampled_rows(dataset, rows=DEFAULT_NUM_ROWS, max_batches=64):
    """(x, y, sample_weight): rows of the first batches of a PoissonSampler's (mapped)
    dataset, concatenated until ``rows`` rows, or None if it is not a sampler's dataset or
    its elements cannot be concatenated."""
    from tf_dp.data.poisson import sampler_of

    sampler = sampler_of(dataset)
    if sampler is None:
        return None
    parts, count = [], 0
    for element in dataset.take(max_batches):
        if sampler.schedule is not None:
            element = element[0]  # (batch, phase)
        batch = keras.utils.unpack_x_y_sample_weight(element)
        leaves = [t for t in tf.nest.flatten(batch) if t is not None]
        if not leaves:
            return None
        n = int(leaves[0].shape[0])
        if n:
            parts.append(batch)
            count += n
        if count >= rows:
            break
    if count < 2:
        return None
    try:
        return tuple(tf.nest.map_structure(
            lambda *t: None if t[0] is None else tf.concat(t, axis=0), *parts))
    except (ValueError, TypeError, tf.errors.InvalidArgumentError):
        return None  # ragged structure across batches (e.g. padded to different lengths)


@dataclasses.dataclass
class _Pass:
    outputs: list  # flat model outputs
    losses: tf.Tensor  # (B,)
    grads: list  # gradient of sum_i c_i l_i for each variable


@dataclasses.dataclass
class _Comparison:
    """A batch built from the reference rows, and which of its rows to compare."""

    description: str
    index: list  # reference row of each row of this batch
    rows: list  # rows of this batch compared with the same rows of the reference batch
    removal: bool = False  # the batch is smaller than the reference


class _Checker:
    """The passes and comparisons of one check (see the module docstring)."""

    def __init__(self, model, per_example_loss, variables, replay, rtol):
        self.model = model
        self.loss = per_example_loss
        self.handles = [v.value if hasattr(v, "value") else v for v in variables]
        self.replay = replay
        self.rtol = rtol

    def run(self, xs, ys, n):
        # One trace with an unknown batch size serves every pass (RNNs run ~20x slower
        # eagerly than traced).
        compiled = self._compiled(xs, ys)
        run_pass = _padded(compiled, n)
        try:
            # Every variable the pass reads or writes, before any pass runs (tracing runs
            # none): the state before the data touched it.
            watched = self._watch(run_pass.variables(xs, ys, np.ones(n)))
            start = [_snapshot(v) for v in watched]
            finite = _finite_rows(run_pass, xs, ys, n)
        except Exception as err:  # noqa: BLE001 - the private step will report it properly
            _warn_unchecked(f"the model could not be called on {n} rows ({_error_kind(err)})")
            return False  # nothing compared: the model must not be marked as checked
        if len(finite) < n:
            # An example whose pass overflows (0 * inf is NaN in the weighted sums) would
            # leave nothing comparable, so whether the check ran would tell it was among the
            # probe rows (session 22 audit); the private step gives it factor 0. The check
            # runs on the other rows.
            if len(finite) < 2:
                _warn_unchecked("fewer than 2 of the probe rows could be run with a finite "
                                "output, loss and gradient")
                return False
            xs, ys, n = _take(xs, finite), _take(ys, finite), len(finite)
            run_pass = _padded(compiled, n)
        h = n // 2
        # At most 1/n each (see _finite_rows): no weighted sum exceeds the largest term.
        coef = np.random.default_rng(0x1D).uniform(0.5, 1.5, size=n) / (1.5 * n)
        first, second = list(range(h)), list(range(h, n))
        comparisons = [
            _Comparison("when the other examples of the batch were replaced",
                        first + [first[i % h] for i in range(n - h)], first),
            # The mirror image: rows that depend only on earlier rows (a cumulative sum over
            # the batch) are seen here.
            _Comparison("when the other examples of the batch were replaced",
                        [second[i % (n - h)] for i in range(h)] + second, second),
            _Comparison(f"when the batch changed from {n} to {h} examples, padded to a "
                        "larger size (a layer that depends on the batch size, e.g. divides "
                        "by it, mixes examples too)",
                        first, first, removal=True),
        ]
        try:
            refs = {"first": run_pass(xs, ys, _masked(coef, first)),
                    "second": run_pass(xs, ys, _masked(coef, second))}
        except Exception as err:  # noqa: BLE001 - the private step will report it properly
            _warn_unchecked(f"the model could not be called on {n} rows ({_error_kind(err)})")
            return False  # nothing compared: the model must not be marked as checked
        self._refuse_state_written_from_data(run_pass, xs, ys, coef,
                                             [c.index for c in comparisons[:2]], watched, start)
        for comp in comparisons:
            ref = refs["first" if comp.rows == first else "second"]
            try:
                got = run_pass(_take(xs, comp.index), _take(ys, comp.index),
                               _masked(coef[comp.index], comp.rows), grown=comp.removal)
            except Exception as err:  # noqa: BLE001
                if not comp.removal:
                    raise
                warnings.warn(f"tf_dp: the per-example check could not call the model on "
                              f"{h} rows padded to a larger batch ({_error_kind(err)}); only "
                              "batches of "
                              f"{n} rows were compared, so a layer that depends on the batch "
                              "size would go unnoticed.", UserWarning, stacklevel=5)
                continue
            diff = self._differs(ref, got, comp.rows)
            if diff is None:
                continue
            if not self._replayable(run_pass, xs, ys, ref, coef, comp.rows):
                _warn_unchecked("the forward pass is random in a way that cannot be replayed "
                                "(random ops outside Keras seed generators)")
                return False
            stochastic_off = False
            if comp.removal and _stochastic_layers(self.model):
                # The removal test assumes random layers draw a batch's first rows alike for
                # any batch size (true of Keras' stateless ops); confirm without them.
                stochastic_off = True
                with _stochastic_layers_off(self.model):
                    run_off = _padded(self._compiled(xs, ys), n)
                    ref = run_off(xs, ys, _masked(coef, first))
                    got = run_off(_take(xs, first), _take(ys, first), _masked(coef[first], first),
                                  grown=True)
                diff = self._differs(ref, got, comp.rows)
                if diff is None:
                    continue
            raise ValueError(self._message(xs, comp, diff, n, stochastic_off))
        return True

    def _watch(self, captured):
        """The variables the state check compares (see ``_refuse_state_written_from_data``):
        the model's, and those the traced pass captures from outside the model (a raw
        ``tf.Variable`` attribute, a metric held by a layer, a global), which every pass then
        replays too. Seed generators' states are left out: they advance alike for any data
        and are replayed. Outside variables are recorded for the report (``STATE_ASSUMED``)."""
        seeds = {id(_handle(v)) for v in seed_states(self.model)}
        own = [v for v in self.model.variables if id(_handle(v)) not in seeds]
        known = {id(_handle(v)) for v in own} | seeds
        outside = [v for v in captured if id(v) not in known]
        _, _, state, saved = self.replay
        replayed = {id(_handle(v)) for v in state}
        for v in outside:
            if id(v) not in replayed and _size(v) <= _MAX_SAVED_ENTRIES:
                state.append(v)
                saved.append(tf.identity(v.read_value()))
        if outside:
            _OUTSIDE_STATE[self.model] = sorted({v.name.split(":")[0] for v in outside})
        return own + outside

    def _refuse_state_written_from_data(self, run_pass, xs, ys, coef, others, watched, start):
        """Raises if a training-mode pass writes a variable from the data (``watched``, whose
        values before any pass are ``start``): from the same starting state, a pass on the
        batch and passes on the batch with one half replaced by copies of the other (rows
        ``others``: either half, so that a statistic such as a maximum differs wherever it
        lies) must leave every variable bit for bit the same. Data-independent writes pass:
        a step counter, a power iteration on the weights (SpectralNormalization normalises
        its kernel in the forward pass). A variable too large to copy must not be written at
        all, by any pass of the check."""
        after = []
        for index in [list(range(_num_rows(xs)))] + list(others):
            # run_pass replays every copied variable first (``_replay``: the model's and the
            # outside ones ``_watch`` added); ``_preserved_state`` restores them at the end.
            run_pass(_take(xs, index), _take(ys, index), coef[index])
            after.append([_snapshot(v) for v in watched])
        for v, s, first, *rest in zip(watched, start, *after):
            if not all(_same(first, b) for b in rest) or (s[0] != "copy"
                                                          and not _same(s, first)):
                raise ValueError(_state_message(self.model, v, _num_rows(xs)))

    def _pass(self, xs, ys, coef):
        """One replayed training-mode pass: outputs, per-example losses (unit weights) and
        the gradient of ``sum_i coef_i l_i``."""
        with tf.GradientTape() as tape:
            tape.watch(self.handles)
            # Under an outer name scope: a model whose name starts with "_" is not a valid
            # *root* scope in a graph, and Keras would leave its scope on its stack.
            with tf.name_scope("tf_dp_independence_check"):
                y_pred = self.model(xs, training=True)
            losses = self.loss(ys, y_pred, None)
            objective = tf.reduce_sum(losses * tf.cast(coef, losses.dtype))
        grads = tape.gradient(objective, self.handles,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return tf.nest.flatten(y_pred), losses, grads

    def _compiled(self, xs, ys):
        return _compiled_pass(self._pass, self.replay, xs, ys)

    def _replayable(self, run_pass, xs, ys, ref, coef, rows):
        again = run_pass(xs, ys, _masked(coef, rows))
        return self._differs(ref, again, list(range(_num_rows(xs)))) is None

    def _differs(self, ref, got, rows):
        """What differs between two passes at ``rows`` (outputs, loss, gradient), or None."""
        for a, b in zip(ref.outputs, got.outputs):
            if not _rows_close(a, b, rows, self.rtol):
                return "output"
        if not _rows_close(ref.losses, got.losses, rows, self.rtol):
            return "loss"
        if not _grads_close(ref.grads, got.grads, self.rtol):
            return "gradient"
        return None

    def _message(self, xs, comp, diff, n, stochastic_off):
        where, layer = (self._locate(xs, comp, stochastic_off) if diff == "output"
                        else (None, None))
        subject = {"output": "the model's output", "loss": "the per-example loss",
                   "gradient": "the gradient of the per-example loss"}[diff]
        if where is None:
            where = {"loss": "The loss function",
                     "gradient": "The model's gradient (its forward values do not mix, so a "
                                 "custom gradient or a stop_gradient does)"}.get(diff, "The model")
        extra = ""
        if isinstance(layer, keras.layers.BatchNormalization):
            extra = (" It is a BatchNormalization layer in training mode: its batch "
                     "statistics mix examples.")
        return (f"tf_dp: {where} mixes the examples of a batch: {subject} for one example "
                f"changed {comp.description} (checked on {n} rows of the first batch, "
                f"training=True).{extra} {_WHY} {_WHAT_TO_DO}")

    def _locate(self, xs, comp, stochastic_off):
        """(Its description, the layer) of the first layer call whose inputs agree at the
        compared rows and whose outputs do not; (None, None) if none is found."""
        n, n_got = _num_rows(xs), len(comp.index)
        off = _stochastic_layers_off(self.model) if stochastic_off else contextlib.nullcontext()
        try:
            with off:  # eagerly: the recorded values are compared
                with _recorded_calls(self.model) as ref_calls:
                    _replay(self.replay)
                    self.model(xs, training=True)
                with _recorded_calls(self.model) as got_calls:
                    _replay(self.replay)
                    self.model(_take(xs, comp.index), training=True)
        except Exception:  # noqa: BLE001 - locating is a courtesy; the refusal stands
            return None, None
        if len(ref_calls) != len(got_calls):
            return None, None

        def clean(ts_a, ts_b):
            return all(_rows_close(a, b, comp.rows, self.rtol, n, n_got)
                       for a, b in zip(ts_a, ts_b))

        for (layer, ins_a, outs_a), (_, ins_b, outs_b) in zip(ref_calls, got_calls):
            if clean(ins_a, ins_b) and not clean(outs_a, outs_b):
                kind = type(layer).__name__
                if _sublayers(layer):
                    return (f"The call of {kind} {layer.name!r} itself (outside its "
                            "sublayers)"), layer
                return f"Layer {layer.name!r} ({kind})", layer
        return None, None


def seed_states(layer) -> list:
    """The state variables of the Keras seed generators in ``layer`` (and its sublayers)."""
    return [g.state for g in _seed_generators(layer)]


#: model -> names of variables outside the model that its checked pass captured.
_OUTSIDE_STATE = weakref.WeakKeyDictionary()


def outside_state(model) -> list:
    """Names of the variables outside ``model``'s own (raw ``tf.Variable`` attributes,
    metrics held by layers, globals) that its training-mode pass read or wrote when it was
    last checked: state the check saw unchanged on its probe, which the guarantee then
    assumes is never written from the data."""
    return list(_OUTSIDE_STATE.get(model, ()))


def _handle(v):
    """The ``tf.Variable`` behind a Keras variable (itself for a ``tf.Variable``)."""
    value = getattr(v, "value", None)
    return value if isinstance(value, tf.Variable) else v


def _snapshot(v):
    """A copy of ``v``, or for a large one (a frozen table) a fingerprint: no copy of a
    table that no forward pass writes."""
    value = _handle(v).read_value()
    if _size(v) <= _MAX_SAVED_ENTRIES:
        return ("copy", tf.identity(value))
    flat = tf.cast(tf.reshape(value, [-1]), tf.float64)
    weights = tf.sin(tf.range(tf.size(flat, out_type=tf.int64), dtype=tf.float64) + 1.0)
    return ("fingerprint", tf.reduce_sum(flat * weights))


def _same(a, b):
    if a[0] == "fingerprint":
        return bool(a[1].numpy() == b[1].numpy())
    x, y = a[1].numpy(), b[1].numpy()
    return x.shape == y.shape and bool(np.all((x == y) | (np.isnan(x) & np.isnan(y))
                                              if x.dtype.kind in "fc" else x == y))


def _state_message(model, variable, n):
    owner = None
    for layer in _internals.all_layers(model):
        if any(_handle(w) is _handle(variable) for w in layer.weights) or any(
                a is variable for a in vars(layer).values()):
            owner = layer  # the deepest layer holding it comes last
    where = (f"Layer {owner.name!r} ({type(owner).__name__})" if owner is not None
             else "The model")
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    stateful = (" A stateful RNN carries its states from batch to batch: use stateful=False."
                if getattr(owner, "stateful", False) else "")
    kind = "trainable" if variable.trainable else "non-trainable"
    return (f"tf_dp: {where} writes its {kind} variable {name!r} from the training data in "
            f"its forward pass: its value after a training-mode pass changed when other "
            f"examples were passed (checked on {n} rows of the first batch). That write is "
            "outside the DP optimizer (no clipping, no noise, not accounted) and is released "
            "with the model (weights, checkpoints, saved files), and it feeds later steps, so "
            f"the reported epsilon would not hold.{stateful} Compute such statistics outside "
            "training (on public data), or remove the write.")


def _padded(run_pass, n):
    """``run_pass`` on batches padded as the private step pads them (copies of their first
    row, coefficient 0, to a multiple of 16 rows and at least 16): below 16 rows, and between
    sizes that are not multiples of 16, TensorFlow's CPU kernels round a row differently for
    different batch sizes. Comparing unpadded passes of 8 and 4 rows, a crafted example made
    the check refuse a per-example model whenever it was among the probe rows: membership
    revealed by whether training started (session 22 audit). Every pass has the reference
    batch's padded size (``n`` rows) unless ``run(..., grown=True)``: one multiple of 16
    more, the second size the removal comparison needs to see a layer that depends on the
    batch size. Outputs and losses come back with the real rows only (tensors whose leading
    axis is not the batch's are kept)."""
    from tf_dp.core import private_step

    reference = private_step.padded_row_count(n)

    def run(x, y, coef, grown=False):
        m = _num_rows(x)
        rows = max(reference + (private_step.ROW_MULTIPLE if grown else 0),
                   private_step.padded_row_count(m))
        if rows > m:
            index = list(range(m)) + [0] * (rows - m)
            x, y = _take(x, index), _take(y, index)
            coef = np.concatenate([np.asarray(coef, np.float64), np.zeros(rows - m)])
        result = run_pass(x, y, coef)
        return _Pass([_head(t, m, rows) for t in result.outputs], _head(result.losses, m, rows),
                     result.grads)

    def variables(x, y, coef):
        return run_pass.variables(x, y, coef)

    run.variables = variables
    return run


def _head(t, m, rows):
    """The first ``m`` rows of ``t`` if its leading axis has the padded batch's ``rows``."""
    if rows == m or _leading(t) != rows:
        return t
    return t[:m]


def _finite_rows(run_pass, xs, ys, n):
    """The probe rows whose output, loss and gradient are finite and on which the model
    does not raise (all of them, unless the whole batch fails: then each row alone). The
    comparisons weight rows by at most 1/n, so a batch whose all-ones pass is finite cannot
    overflow in them (session 22 audit: weights up to 1.5 overflowed a gradient just below
    the float32 maximum, and the check gave up exactly when that example was a probe row)."""
    return _rows_that_run(lambda x, y, m: _finite_pass(run_pass(x, y, np.ones(m))), xs, ys, n)


def _rows_that_run(finite, xs, ys, n):
    """The rows i of the probe for which ``finite(x, y, m)`` holds and does not raise: all
    of them if it holds for the whole batch, else each row alone."""
    try:
        if finite(xs, ys, n):
            return list(range(n))
    except Exception:  # noqa: BLE001 - a row the model cannot take: found below
        pass
    keep = []
    for i in range(n):
        try:
            if finite(_take(xs, [i]), _take(ys, [i]), 1):
                keep.append(i)
        except Exception:  # noqa: BLE001 - left out, as the private step would stop on it
            pass
    return keep


def _finite_pass(result):
    def finite(t):
        if isinstance(t, tf.RaggedTensor):
            t = t.flat_values
        if not tf.is_tensor(t) or not t.dtype.is_floating:
            return True
        return bool(tf.reduce_all(tf.math.is_finite(t)))

    return all(finite(t) for t in [*result.outputs, result.losses, *result.grads]
               if t is not None)


def _masked(coef, rows):
    """``coef`` at ``rows``, 0 elsewhere."""
    out = np.zeros(len(coef))
    out[rows] = np.asarray(coef)[rows]
    return out


def _relaxed(t):
    """The spec of ``t`` with an unknown batch size (None: not a tensor)."""
    if isinstance(t, tf.Tensor):
        return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)
    if isinstance(t, tf.RaggedTensor):
        return tf.RaggedTensorSpec([None] + t.shape[1:].as_list(), t.dtype, t.ragged_rank,
                                   t.row_splits.dtype)
    return None


def _compiled_pass(pass_fn, replay, xs, ys):
    """``pass_fn(x, y, coef)`` traced once for any batch size (inputs shaped like ``xs``,
    ``ys``); each call replays the random state first and returns a ``_Pass``."""

    x_spec = tf.nest.map_structure(_relaxed, xs)
    y_spec = tf.nest.map_structure(_relaxed, ys) if ys is not None else None
    specs = tf.nest.flatten((x_spec, y_spec))
    coef_spec = tf.TensorSpec([None], tf.float64)
    if ys is None:
        fn = lambda x, c: pass_fn(x, None, c)  # noqa: E731
        signature = [x_spec, coef_spec]
    else:
        fn = pass_fn
        signature = [x_spec, y_spec, coef_spec]
    if any(s is None for s in specs):
        traced = tf.function(fn, reduce_retracing=True)
    else:
        traced = tf.function(fn, input_signature=signature)

    def run(x, y, coef):
        _replay(replay)
        args = (x, tf.constant(coef, tf.float64)) if ys is None else (
            x, y, tf.constant(coef, tf.float64))
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            # Inside a strategy's scope: gradients of distributed variables exist only in a
            # replica context. Every replica computes the same pass; keep the first.
            strategy = tf.distribute.get_strategy()
            result = strategy.experimental_local_results(strategy.run(traced, args=args))[0]
        else:
            result = traced(*args)
        outputs, losses, grads = result
        return _Pass(list(outputs), losses, list(grads))

    def variables(x, y, coef):
        """The variables the traced pass captures (it is traced, not run); [] where it
        cannot be traced outside a replica context (distributed variables)."""
        args = (x, tf.constant(coef, tf.float64)) if ys is None else (
            x, y, tf.constant(coef, tf.float64))
        try:
            return list(traced.get_concrete_function(*args).graph.variables)
        except Exception:  # noqa: BLE001 - the model's own variables are watched anyway
            return []

    run.variables = variables
    return run


# ------------------------------------------------------------------ ghost rows are examples

# Largest batch the row check builds: a ghost-rule layer whose input has a fixed leading axis
# of L entries (not the batch: a time-major layout) is probed again on a batch of L rows.
_ROW_PROBE_MAX = 1024

_ROWS_WHY = (
    "Its per-example gradient norms would then be norms of rows, not of examples, and one "
    "example could move the clipped sum by more than l2_norm_clip (the reported epsilon "
    "would not hold).")
_ROWS_WHAT_TO_DO = (
    "Keep the batch axis first and in order around this layer (no transpose, roll, reverse, "
    "gather or sort over the batch axis, no time-major layout), or compile the DP optimizer "
    "with norm_strategy=\"vmap\" (exact per-example gradients, which need only a per-example "
    "model).")


def check_ghost_rows_are_examples(model: keras.Model, x, y, sample_weight,
                                  per_example_loss: Callable,
                                  variables: Optional[Sequence] = None,
                                  num_rows: int = DEFAULT_NUM_ROWS,
                                  rtol: float = DEFAULT_RTOL) -> bool:
    """Raises ``ValueError`` if a layer with a ghost-norm rule does not see the batch's
    examples, in order, as the rows of its input and of its output gradient.

    A ghost rule (``tf_dp.core.ghost``) forms example k's gradient of its layer's weights
    from row k of the layer's input and row k of the gradient at its output. A model can be
    per-example overall (:func:`check_per_example_independence` passes) and still feed such a
    layer a tensor whose rows are not its examples: ``Dense`` applied time-major
    (``transpose(x, [1, 0, 2])`` with as many steps as examples), to a batch rolled, reversed,
    gathered or sorted along axis 0 and put back in order after it, or followed by such a
    permutation. The rule then clips rows, not examples: one example can move the clipped
    sum by several times the clipping norm.

    Tested on up to ``num_rows`` rows of a real batch (rows of sample weight 0 skipped), in
    training mode, with random layers replayed (as :func:`check_per_example_independence`),
    for every call of every layer ``tf_dp.core.ghost.capturable_layers`` lists that holds a
    variable of ``variables``:

    * inputs and outputs: for ``s`` rows, ``2 * ceil(log2 s)`` passes each replace a set of
      examples S by other rows of the batch (the examples whose index has bit b set, and the
      complement, for every bit b); every tensor of the call whose leading axis has ``s``
      entries may change only at the rows in S. A row k that depends on an example m != k is
      seen in the pass where m is in S and k is not.
    * output gradients: the gradient at every floating output of the call of
      ``sum_i c_i l_i`` and of ``sum_i c_i rho_i l_i`` (``c`` random, ``rho`` distinct
      ratios): row k must be ``rho_k`` times the first at every row k, i.e. only example k's
      loss reaches row k (a permutation after the layer, ``roll(Dense(x), 1, axis=0)``).
    * a tensor of such a call whose leading axis has L != s entries (not the batch axis, but
      equal to the batch size whenever a batch has L examples, as time-major steps) is probed
      again on a batch of L rows (the rows repeated; L <= 1024, larger: a warning).

    Not seen: a row that depends on another example only below the tolerance or only at
    batch contents or sizes the probe does not produce; layers called inside a control-flow
    body are checked with eager passes.

    Returns:
      True if the check ran and passed (or no layer has a rule), False if it could not
      compare (fewer than 2 rows, the model could not be called, or its passes could not be
      replayed; then with a warning).

    Raises:
      ValueError: naming the layer (and which call of a shared layer) whose rows are not the
        batch's examples in order.
    """
    probe = _built_probe(model, x, y, sample_weight, num_rows, rtol, _warn_rows_unchecked)
    if probe is None:
        return False
    xs, ys = probe
    layers = _ghost_layers(model, variables)
    if not layers:
        return True
    low_precision = _low_precision(model)
    if low_precision:
        rtol = max(rtol, _LOW_PRECISION_RTOL)
    with _preserved_state(model) as replay:
        return _RowChecker(model, layers, per_example_loss, replay, rtol,
                           power_of_two_ratios=low_precision).run(xs, ys)


def _uses_ghost_rules(model, norm_strategy) -> bool:
    """Whether the private step of ``model`` forms norms with ghost rules (True if unknown)."""
    from tf_dp.core import norm_strategies

    if norm_strategy is None:
        try:
            optimizer = getattr(model, "optimizer", None)
        except Exception:  # noqa: BLE001 - not compiled
            optimizer = None
        for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            strategy = getattr(candidate, "norm_strategy", None)
            if isinstance(strategy, norm_strategies.NormStrategy):
                norm_strategy = strategy
                break
    if norm_strategy is None:
        return True
    try:
        strategy = norm_strategies.get(norm_strategy)
    except (ValueError, TypeError):
        return True  # "jl" without its r, or unknown: check
    return not isinstance(strategy, norm_strategies.Vectorized)


def _ghost_layers(model, variables):
    """The layers ghost rules capture in ``model`` that hold a variable of ``variables``."""
    from tf_dp.core.ghost.capture import capturable_layers

    wanted = set()
    for v in (model.trainable_variables if variables is None else variables):
        wanted.add(id(v))
        wanted.add(id(getattr(v, "value", v)))
    return [layer for layer in capturable_layers(model)
            if any(id(w) in wanted for w in layer.weights)]


@dataclasses.dataclass
class _RowPass:
    values: list  # flat recorded tensors, described by _RowChecker.layout
    grads_1: list  # gradient of sum_i c_i l_i at each of _RowChecker.targets
    grads_2: list  # of sum_i c_i rho_i l_i


class _RowChecker:
    """The passes and comparisons of one :func:`check_ghost_rows_are_examples`."""

    def __init__(self, model, layers, per_example_loss, replay, rtol,
                 power_of_two_ratios=False):
        self.model, self.layers, self.loss = model, layers, per_example_loss
        self.replay, self.rtol = replay, rtol
        self.power_of_two_ratios = power_of_two_ratios
        self.layout = []  # (layer, call number, "input"/"output", position) per value
        self.targets = []  # indices of the values whose gradient is taken
        self.inner = False  # a layer was called inside a control-flow body (not returned)
        self.rng = np.random.default_rng(0x6057)

    # -- passes -------------------------------------------------------------------------

    def _pass(self, x, y, c1, c2):
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        calls, counts = [], {}
        tape = tf.GradientTape(persistent=True)

        def make(layer, bound):
            def call(*args, **kwargs):
                out = bound(*args, **kwargs)
                number = counts.get(id(layer), 0)
                counts[id(layer)] = number + 1
                if graph is not None and tf.compat.v1.get_default_graph() is not graph:
                    self.inner = True  # a tensor of a loop body cannot leave the function
                    return out
                outs = _tensors(out)
                for t in outs:
                    if isinstance(t, tf.Tensor) and t.dtype.is_floating:
                        tape.watch(t)
                calls.append((layer, number, _tensors((args, kwargs)), outs))
                return out
            return call

        with _patched_calls(self.layers, make):
            with tape:
                with tf.name_scope("tf_dp_ghost_rows_check"):
                    y_pred = self.model(x, training=True)
                losses = self.loss(y, y_pred, None)
                objective_1 = tf.reduce_sum(losses * tf.cast(c1, losses.dtype))
                objective_2 = tf.reduce_sum(losses * tf.cast(c2, losses.dtype))
        layout, values = [], []
        for layer, number, ins, outs in calls:
            for kind, tensors in (("input", ins), ("output", outs)):
                for position, t in enumerate(tensors):
                    layout.append((layer, number, kind, position))
                    values.append(t)
        targets = [i for i, (t, place) in enumerate(zip(values, layout))
                   if place[2] == "output" and isinstance(t, tf.Tensor)
                   and t.dtype.is_floating]
        self.layout, self.targets = layout, targets
        wrt = [values[i] for i in targets]
        zero = tf.UnconnectedGradients.ZERO
        grads_1 = tape.gradient(objective_1, wrt, unconnected_gradients=zero)
        grads_2 = tape.gradient(objective_2, wrt, unconnected_gradients=zero)
        dense = lambda gs: [tf.convert_to_tensor(g) for g in gs]  # noqa: E731
        return values, dense(grads_1), dense(grads_2)

    def _runner(self, xs, ys):
        """``run(x, y, c1, c2) -> _RowPass``: one trace for any batch size (eager passes if
        a layer is called inside a control-flow body), the random state replayed first."""
        x_spec = tf.nest.map_structure(_relaxed, xs)
        y_spec = tf.nest.map_structure(_relaxed, ys) if ys is not None else None
        coef = tf.TensorSpec([None], tf.float64)
        if ys is None:
            fn = lambda x, c1, c2: self._pass(x, None, c1, c2)  # noqa: E731
            signature = [x_spec, coef, coef]
        else:
            fn, signature = self._pass, [x_spec, y_spec, coef, coef]
        if any(s is None for s in tf.nest.flatten((x_spec, y_spec))):
            traced = tf.function(fn, reduce_retracing=True)
        else:
            traced = tf.function(fn, input_signature=signature)
        state = {"fn": traced}

        def call(fn, args):
            if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
                strategy = tf.distribute.get_strategy()
                return strategy.experimental_local_results(strategy.run(fn, args=args))[0]
            return fn(*args)

        def run(x, y, c1, c2):
            c1, c2 = tf.constant(c1, tf.float64), tf.constant(c2, tf.float64)
            args = (x, c1, c2) if ys is None else (x, y, c1, c2)
            _replay(self.replay)
            values, grads_1, grads_2 = call(state["fn"], args)
            if self.inner and state["fn"] is traced:
                state["fn"] = fn  # eager: every call is recorded
                _replay(self.replay)
                values, grads_1, grads_2 = call(fn, args)
            return _RowPass(list(values), list(grads_1), list(grads_2))

        return run

    # -- the check ----------------------------------------------------------------------

    def run(self, xs, ys):
        n = _num_rows(xs)
        run = self._runner(xs, ys)
        try:
            finite = self._finite_rows(run, xs, ys, n)
        except Exception as err:  # noqa: BLE001 - the private step will report it properly
            _warn_rows_unchecked(f"the model could not be called on {n} rows "
                                 f"({_error_kind(err)})")
            return False
        if len(finite) < n:
            # As in the per-example check: a row whose pass overflows is left out, so that
            # whether the check could compare does not tell it was among the probe rows.
            if len(finite) < 2:
                _warn_rows_unchecked("fewer than 2 of the probe rows could be run with finite "
                                     "values and gradients")
                return False
            return self.run(_take(xs, finite), _take(ys, finite))
        donors = _donors(xs, n)
        other_sizes = self._check_size(run, xs, ys, n, n, donors)
        if other_sizes is None:
            return False
        for size in sorted(other_sizes):
            if size > _ROW_PROBE_MAX:
                _warn_rows_unchecked(
                    f"a layer's input or output has a leading axis of {size} entries, not the "
                    f"batch's (checked on {n} rows), too many to probe a batch of that size; "
                    "if a batch ever has that many examples, its ghost rule would take those "
                    "rows as examples")
                continue
            if self._check_size(run, xs, ys, size, n, donors) is None:
                return False
        return True

    def _check_size(self, run, xs, ys, s, n, donors):
        """Checks a batch of ``s`` rows (the ``n`` probe rows repeated). Returns the other
        leading sizes seen (at s == n), or None if the passes could not be compared."""
        base = [i % n for i in range(s)]
        # Both weightings at most 1/s per row (see _finite_rows): no sum exceeds its
        # largest term, so a batch whose all-ones pass is finite cannot overflow here.
        c1 = self.rng.uniform(0.5, 1.5, size=s) / (1.5 * s)
        rho = self._ratios(s)
        rho = rho / rho.max()  # still distinct (powers of two under low precision)
        c2 = c1 * rho
        try:
            ref = run(_take(xs, base), _take(ys, base), c1, c2)
            layout = list(self.layout)
            again = run(_take(xs, base), _take(ys, base), c1, c2)
        except Exception as err:  # noqa: BLE001 - the private step will report it properly
            _warn_rows_unchecked(f"the model could not be called on {s} rows "
                                 f"({_error_kind(err)})")
            return None
        if not self._same(ref, again):
            _warn_rows_unchecked("the forward pass is random in a way that cannot be replayed "
                                 "(random ops outside Keras seed generators)")
            return None
        passes = [ref]
        for subset in _subsets(s):
            index = [donors[base[i]] if i in subset else base[i] for i in range(s)]
            got = run(_take(xs, index), _take(ys, index), c1, c2)
            if list(self.layout) != layout:
                _warn_rows_unchecked("the layers were called differently when other examples "
                                     "were in the batch")
                return None
            self._check_rows(ref, got, layout, subset, s, n)
            passes.append(_RowPass([], got.grads_1, got.grads_2))  # values no longer needed
        for result in passes:  # after the rows: a permuted input is named as such
            self._check_gradients(result, layout, s, n, rho)
        if s != n:
            return set()
        return {size for size in (_leading(t) for t in ref.values)
                if size is not None and size >= 2 and size != s}

    @staticmethod
    def _finite_rows(run, xs, ys, n):
        def finite(x, y, m):
            result = run(x, y, np.ones(m), np.ones(m))
            return _finite_pass(_Pass(result.values, None, result.grads_1))

        return _rows_that_run(finite, xs, ys, n)

    def _ratios(self, s):
        """Distinct ratios rho_k, in a random order. Under float16/bfloat16 they
        are powers of two: scaling a per-example backward pass by 2^e is exact in any
        precision (barring overflow), so an example's rescaled row is bit-identical where
        other ratios leave bfloat16's rounding, amplified through attention, at 5 %
        (session 22: a per-example MultiHeadAttention model was refused). Exponents stay
        within [-4, 4]; beyond 9 rows they repeat in a random arrangement, so a layer
        that mixes rows is missed only if every pair of rows it mixes shares a ratio."""
        if not self.power_of_two_ratios:
            return self.rng.permutation(np.linspace(0.5, 2.0, s))
        exponents = self.rng.permutation(s) % 9 - 4
        return np.ldexp(1.0, exponents)

    def _same(self, a, b):
        if len(a.values) != len(b.values):
            return False
        for ta, tb in zip(a.values + a.grads_1, b.values + b.grads_1):
            rows_a, rows_b = _row_matrix(ta), _row_matrix(tb)
            if rows_a is None or rows_b is None:
                continue
            if np.any(_changed(rows_a, rows_b, self.rtol)):
                return False
        return True

    def _check_rows(self, ref, got, layout, subset, s, n):
        """Rows outside ``subset`` (the examples replaced) must not change."""
        outside = np.ones(s, bool)
        outside[sorted(subset)] = False
        for place, ta, tb in zip(layout, ref.values, got.values):
            if _leading(ta) != s or _leading(tb) != s:
                continue
            rows_a, rows_b = _row_matrix(ta), _row_matrix(tb)
            if rows_a is None or rows_b is None:
                continue
            moved = np.flatnonzero(_changed(rows_a, rows_b, self.rtol) & outside)
            if moved.size:
                layer, number, kind, position = place
                what = f"its {kind}" + (f" (tensor {position + 1} of the call)"
                                         if position else "")
                shown = sorted(subset)
                detail = (f"row {int(moved[0])} of {what} changed when only examples "
                          f"{shown[:8]}{' ...' if len(shown) > 8 else ''} of the batch were "
                          "replaced")
                raise ValueError(self._message(layer, number, kind, detail, s, n))

    def _check_gradients(self, result, layout, s, n, rho):
        """The output gradient's row k must hold example k's loss only."""
        for index, g1, g2 in zip(self.targets, result.grads_1, result.grads_2):
            if _leading(g1) != s:
                continue
            a = _row_matrix(g1)
            b = _row_matrix(g2)
            if a is None or b is None or not isinstance(a, np.ndarray):
                continue
            # Entries below the smallest normal number of the gradient's dtype have lost their
            # relative precision (float16 gradients of small losses underflow): noise here.
            floor = a.shape[1] * (4 * _TINY.get(g1.dtype, _TINY[tf.float32])) ** 2
            mixed = np.flatnonzero(_changed(a * rho[:, None], b, self.rtol, floor))
            if mixed.size:
                layer, number, _, _ = layout[index]
                detail = (f"the gradient at row {int(mixed[0])} of its output comes from the "
                          f"losses of other examples than example {int(mixed[0])}")
                raise ValueError(self._message(layer, number, "output-gradient", detail, s, n))

    def _message(self, layer, number, kind, detail, s, n):
        calls = 1 + max(place[1] for place in self.layout if place[0] is layer)
        which = f" (its call {number + 1} of {calls}: a shared layer)" if calls > 1 else ""
        where = (f"checked on {s} rows of the first batch" if s == n else
                 f"checked on a batch of {s} rows repeating the first batch's {n}: on {n} rows "
                 f"this layer already saw a leading axis of {s}, which is therefore not the "
                 f"batch axis, yet its rule reads it as the batch whenever a batch has {s} "
                 "examples")
        return (f"tf_dp: the {kind} rows of layer {layer.name!r} ({type(layer).__name__}){which} "
                f"are not the batch's examples in order: its ghost-norm rule takes row k of its "
                f"input and of its output gradient as example k's, but {detail} ({where}, "
                f"training=True). {_ROWS_WHY} {_ROWS_WHAT_TO_DO}")


# The smallest normal number of each floating dtype (bfloat16 has float32's exponent range).
_TINY = {tf.float16: 2.0 ** -14, tf.bfloat16: 2.0 ** -126, tf.float32: 2.0 ** -126,
         tf.float64: 2.0 ** -1022}


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure)
            if isinstance(t, (tf.Tensor, tf.RaggedTensor))]


def _leading(t):
    if isinstance(t, tf.RaggedTensor):
        return int(t.nrows())
    if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank == 0:
        return None
    return int(t.shape[0]) if t.shape[0] is not None else int(tf.shape(t)[0])


def _row_matrix(t):
    """``t`` as float64 rows: an (s, -1) array, or a list of s 1-D arrays (ragged rows)."""
    if isinstance(t, tf.RaggedTensor):
        return [_as_float(np.ravel(_flat(t[k]))) for k in range(int(t.nrows()))]
    if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank == 0:
        return None
    return _as_float(np.asarray(_flat(t))).reshape(int(tf.shape(t)[0]), -1)


def _flat(t):
    if isinstance(t, tf.RaggedTensor):
        t = t.flat_values
    if t.dtype == tf.string:
        t = tf.strings.to_hash_bucket_fast(t, 2**31)
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def _as_float(a):
    return np.asarray(a, dtype=np.float64)


def _changed(a, b, rtol, floor=0.0):
    """Which rows of ``a`` and ``b`` differ, relative to the row (``rtol``) and, for rows
    near zero, to the largest row (``rtol / 10``); squared differences up to ``floor`` are
    noise."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape:
        diff = np.sum(np.square(a - b), axis=1)
        norm = np.maximum(np.sum(np.square(a), axis=1), np.sum(np.square(b), axis=1))
    else:
        if len(a) != len(b):
            return np.ones(max(len(a), len(b)), bool)
        diff, norm = [], []
        for ra, rb in zip(a, b):
            ra, rb = np.ravel(ra), np.ravel(rb)
            if ra.shape != rb.shape:
                diff.append(np.inf)
                norm.append(0.0)
                continue
            diff.append(np.sum(np.square(ra - rb)))
            norm.append(max(np.sum(np.square(ra)), np.sum(np.square(rb))))
        diff, norm = np.asarray(diff, np.float64), np.asarray(norm, np.float64)
    if norm.size == 0:
        return np.zeros(0, bool)
    scale = np.max(norm[np.isfinite(norm)], initial=0.0)
    with np.errstate(invalid="ignore"):
        # Not "diff > bound": a NaN difference is a change, not a match.
        return ~(diff <= rtol ** 2 * norm + (rtol / 10) ** 2 * scale + floor)


def _subsets(s):
    """Sets of rows such that for every two rows m != k one set holds m and not k."""
    out = []
    for bit in range(max(1, int(np.ceil(np.log2(s))))):
        ones = {i for i in range(s) if (i >> bit) & 1}
        for subset in (ones, set(range(s)) - ones):
            if subset and len(subset) < s:
                out.append(subset)
    return out


def _donors(xs, n):
    """For each of the ``n`` rows, the next row with different content (itself if none)."""
    leaves = [t for t in tf.nest.flatten(xs) if t is not None]
    keys = []
    for k in range(n):
        parts = []
        for t in leaves:
            row = _flat(t[k]) if tf.is_tensor(t) else np.asarray(t[k])
            parts.append(np.asarray(row).tobytes() + repr(np.shape(row)).encode())
        keys.append(b"|".join(parts))
    donors = []
    for k in range(n):
        donor = next((d % n for d in range(k + 1, k + n) if keys[d % n] != keys[k]), k)
        donors.append(donor)
    return donors


def _warn_rows_unchecked(reason, stacklevel=5):
    warnings.warn("tf_dp: could not check that the layers with ghost-norm rules see the "
                  f"batch's examples in order as their rows: {reason}. A layer fed a "
                  "transposed or batch-permuted tensor would be clipped per row, not per "
                  "example (norm_strategy=\"vmap\" does not rely on rows), so a private "
                  "model's report is voided (caveat UNCHECKED).", UserWarning,
                  stacklevel=stacklevel)


# ------------------------------------------------------------------ probe rows, comparisons


def _validated_probe(x, y, sample_weight, num_rows, rtol):
    """The checks' arguments validated, then ``_probe_rows``."""
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 2:
        raise ValueError(f"`num_rows` must be an integer >= 2, got {num_rows!r}.")
    if not rtol > 0:
        raise ValueError(f"`rtol` must be > 0, got {rtol!r}.")
    return _probe_rows(x, y, sample_weight, num_rows)


def _built_probe(model, x, y, sample_weight, num_rows, rtol, warn):
    """``_validated_probe``'s rows (xs, ys), the model built on them first if it is not (its
    variables must exist before their state is saved); None if there are fewer than 2 rows
    or the model cannot be called on them (then said through ``warn``)."""
    probe = _validated_probe(x, y, sample_weight, num_rows, rtol)
    if probe is None:
        return None
    xs, _ = probe
    if _fully_built(model):
        return probe
    try:
        model(xs, training=False)
    except Exception:  # noqa: BLE001 - a row the model cannot take: build on one that it can
        for i in range(_num_rows(xs)):
            try:
                model(_take(xs, [i]), training=False)
                break
            except Exception as err:  # noqa: BLE001 - the private step will report it
                last = err
        else:
            warn(f"the model could not be called on {_num_rows(xs)} rows ({_error_kind(last)})")
            return None
    return probe


def _error_kind(err) -> str:
    """An exception's type, without its message: TensorFlow's messages quote values of the
    data (``indices[3,2] = 999 is not in [0, 50)``: one example's row, position and value,
    session 22 audit), and the check's warnings must not."""
    return (f"{type(err).__name__}; its message is withheld, as it may quote the data: the "
            "private step reports it if it recurs")


def _probe_rows(x, y, sample_weight, num_rows):
    """Up to ``num_rows`` rows of the batch with positive sample weight, or None if < 2."""
    n = _num_rows(x)
    if n is None:
        return None
    rows = np.arange(n)
    if sample_weight is not None:
        # A row is an example if any of its weights is non-zero (per-time-step weights of a
        # left-padded sequence start with 0), as the private step counts it (real_rows):
        # picking by the first entry left no probe rows, and the model went unchecked
        # (session 21 audit: UnitNormalization(axis=0) trained, 3.23 C).
        w = np.asarray(tf.reshape(tf.convert_to_tensor(sample_weight), [n, -1]))
        rows = rows[np.any(w != 0, axis=1)]
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
    """``t[rows]`` as float64, or None if ``t`` has no batch axis (of size ``batch``)."""
    if isinstance(t, tf.RaggedTensor):
        t = t.to_tensor()
    if not tf.is_tensor(t) or t.shape.rank is None or t.shape.rank == 0:
        return None
    if batch is not None and int(tf.shape(t)[0]) != batch:
        return None
    if t.dtype == tf.string:
        t = tf.strings.to_hash_bucket_fast(t, 2**31)
    return tf.cast(tf.gather(t, rows), tf.float64)


def _rows_close(a, b, rows, rtol, batch_a=None, batch_b=None):
    """Whether ``a[rows]`` and ``b[rows]`` agree to ``rtol`` (norm-wise); True if either has
    no batch axis."""
    a, b = _as_rows(a, rows, batch_a), _as_rows(b, rows, batch_b)
    if a is None or b is None or a.shape != b.shape:
        return True
    return _close(float(tf.reduce_sum(tf.square(a - b))), float(tf.reduce_sum(tf.square(a))),
                  float(tf.reduce_sum(tf.square(b))), rtol)


def _close(diff_sq, a_sq, b_sq, rtol):
    scale = max(a_sq, b_sq)
    return diff_sq <= rtol ** 2 * scale + 1e-30


def _grads_close(ga, gb, rtol):
    diff_sq = a_sq = b_sq = 0.0
    for a, b in zip(ga, gb):
        if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
            # Embedding gradients: compare the touched rows, never the dense table.
            diff_sq += _slices_sq_norm(tf.concat([a.values, -b.values], 0),
                                       tf.concat([a.indices, b.indices], 0))
            a_sq += _slices_sq_norm(a.values, a.indices)
            b_sq += _slices_sq_norm(b.values, b.indices)
            continue
        a = tf.cast(tf.convert_to_tensor(a), tf.float64)
        b = tf.cast(tf.convert_to_tensor(b), tf.float64)
        diff_sq += float(tf.reduce_sum(tf.square(a - b)))
        a_sq += float(tf.reduce_sum(tf.square(a)))
        b_sq += float(tf.reduce_sum(tf.square(b)))
    return _close(diff_sq, a_sq, b_sq, rtol)


def _slices_sq_norm(values, indices):
    unique, position = tf.unique(indices)
    rows = tf.math.unsorted_segment_sum(tf.cast(values, tf.float64), position,
                                        tf.shape(unique)[0])
    return float(tf.reduce_sum(tf.square(rows)))


# ------------------------------------------------------------------ model state and randomness


def _low_precision(model):
    return any(getattr(layer, "compute_dtype", None) in ("float16", "bfloat16")
               for layer in _internals.all_layers(model))


def _fully_built(model):
    return model.built and all(layer.built for layer in
                               _internals.all_layers(model, include_self=False))


def _seed_generators(model):
    gens = []
    for layer in _internals.all_layers(model):
        gens.extend(_internals.seed_generators(layer))
    # Unseeded keras.random calls draw from the global generator.
    glob = _internals.global_seed_generator()
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
    """Yields what every pass replays: the seed generators' states and the model's variables
    (trainable and non-trainable) as they were. Each pass starts from them, so a layer that
    writes a variable in its forward pass (SpectralNormalization normalises its kernel, a
    counter, normalisation statistics, RNN states) does not make two passes differ; at exit
    everything is as it was. Large tables (frozen embeddings) are not copied: no forward pass
    writes them (a pass that does is refused, ``_refuse_state_written_from_data``)."""
    gens = _seed_generators(model)
    seeds = [tf.identity(g.state.value) for g in gens]
    state = [v for v in model.variables
             if not any(v is g.state for g in gens) and _size(v) <= _MAX_SAVED_ENTRIES]
    saved = [tf.identity(v.value) for v in state]
    try:
        yield gens, seeds, state, saved
    finally:
        for v, s in zip(state, saved):
            v.assign(s)
        for g, s in zip(gens, seeds):
            g.state.assign(s)


_MAX_SAVED_ENTRIES = 1 << 22


def _size(v):
    return int(np.prod(v.shape)) if all(d is not None for d in v.shape) else 0


def _replay(replay):
    gens, seeds, state, saved = replay
    for v, s in zip(state, saved):
        v.assign(s)
    for g, s in zip(gens, seeds):
        g.state.assign(s)


def _stochastic_layers(model):
    out = []
    for layer in _internals.all_layers(model):
        own = _internals.seed_generators(layer)
        cell = getattr(layer, "cell", None)
        cells = [cell] + list(getattr(cell, "cells", []) or []) if cell is not None else []
        if own or any(_internals.seed_generators(c) for c in cells):
            out.append(layer)
    return out


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

    layers = list(_internals.all_layers(model))
    with _patched_calls(layers, make):
        yield calls


def _sublayers(layer):
    return _internals.sublayers(layer)


def _warn_unchecked(reason, stacklevel=5):
    warnings.warn(f"tf_dp: could not check that the model treats examples independently: "
                  f"{reason}. A layer that mixes the examples of a batch would break the "
                  "clip bound, so a private model's report is voided (caveat UNCHECKED).",
                  UserWarning, stacklevel=stacklevel)


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
    for layer in _internals.all_layers(model):
        if isinstance(layer, keras.layers.TextVectorization):
            inner_lookups.add(id(getattr(layer, "_lookup_layer", None)))
    for layer in _internals.all_layers(model):
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
