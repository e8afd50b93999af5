"""Capturing a forward pass: registered layers run their ghost rules, which record terms.

Within ``capture(layers, batch_size, tape)`` each layer's ``call`` is replaced, on that instance
and only until the context exits, by its rule (``registry.rule_for``). Rules read weights
under ``tf.stop_gradient``, the value watched by the tape (``GhostContext.read``): autodiff
never needs a weight's gradient through a rule, since the factors give it. So after the backward pass, a weight with terms
whose handle still receives a gradient was also used outside every rule (a tied embedding
used as the output projection, a custom layer reading another layer's kernel): no term
describes that use, and the weight is left to the exact vectorized fallback.
"""

from __future__ import annotations

import contextlib
import logging

import keras
import tensorflow as tf

from tf_dp import _internals
from tf_dp.core.ghost.registry import rule_for
from tf_dp.core.ghost.terms import DirectTerm, EmbeddingTerm, OuterTerm, rows

_LOG = logging.getLogger("tf_dp")


class GhostContext:
    """What a ghost rule records into (the ``ctx`` argument of a rule)."""

    def __init__(self, batch_size, tape=None):
        self.batch_size = batch_size
        self._tape = tape
        self._entries: list = []  # (variable, term) in recording order
        self._read: list = []  # variables read through `read`, per active rule call
        self._leading: list = []  # (layer name, leading axis) still to be checked (finish)
        self._checks: list = []  # the assertions made by `finish` (graph mode)
        self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()

    # -- for rules ------------------------------------------------------------------------

    def batch_input(self, layer, inputs, dtype=None):
        """``inputs`` as a tensor of ``dtype`` (default: the layer's compute dtype), checked
        to have the batch as its leading axis."""
        x = tf.convert_to_tensor(inputs)
        dtype = dtype or layer.compute_dtype
        if x.dtype != tf.as_dtype(dtype):
            x = tf.cast(x, dtype)
        self.check_batch(layer, x)
        return x

    def check_batch(self, layer, x):
        """Asserts that ``x``'s leading axis is the batch (per-example structure intact).

        When either is known only in the graph, the leading axis is read here and the check
        is made at the end of the capture, one assertion for every layer of the forward pass
        (``finish``): an assertion per layer was ~20 graph ops each."""
        static = x.shape[0] if x.shape.rank else None
        if isinstance(self.batch_size, int) and static is not None:
            if static != self.batch_size:
                raise ValueError(_batch_msg(layer, static, self.batch_size))
            return
        leading = tf.shape(x)[0]
        if tf.executing_eagerly() or leading.graph is not self._graph:
            # Eager, or inside a control-flow body of a layer: checked where it is.
            tf.debugging.assert_equal(leading, tf.cast(self.batch_size, tf.int32),
                                      message=_batch_msg(layer, "?", "the batch size"))
            return
        self._leading.append((layer.name, leading))

    def finish(self):
        """The checks ``check_batch`` left for the end of the capture: one assertion that
        every recorded layer's input has the batch as its leading axis.

        Returns the assertions made so far (graph mode; empty when eager, where a failed
        check raises at once). ``backward`` runs the backward pass after them, so nothing
        formed from an output gradient (no factor, norm or sum) can run first: a failed check
        stops the step with this message, whatever order the graph's ops run in."""
        if not self._leading:
            return list(self._checks)
        names = [name for name, _ in self._leading]
        leading = tf.stack([t for _, t in self._leading])
        self._leading = []
        check = tf.debugging.assert_equal(
            leading, tf.cast(self.batch_size, tf.int32), summarize=len(names),
            message=(f"Layers {names} were called on tensors whose leading axes (x, in this "
                     "order) are not all the batch size (y); per-example norms by layer "
                     "formulas need the batch axis first. Compile the DP optimizer with "
                     "norm_strategy='vectorized' for this model."))
        if check is not None:
            self._checks.append(check)
        return list(self._checks)

    def read(self, variable, dtype=None):
        """The value of a weight for use inside a rule (in ``dtype``, default its own)."""
        if self._read:
            self._read[-1].append(variable)
        value = tf.stop_gradient(tf.identity(variable))
        if self._tape is not None:
            # Watched as a tensor: the outputs the rule computes from it are on the tape (their
            # gradients dz are what the factors need), while the variable itself gets no
            # gradient through the rule.
            self._tape.watch(value)
        return tf.cast(value, dtype) if dtype is not None and value.dtype != dtype else value

    def watch(self, tensor):
        """Puts a tensor a rule made on the tape (its gradient is then available as a term's
        ``z``, e.g. the recurrent rule's probe of its input projections)."""
        if self._tape is not None:
            self._tape.watch(tensor)

    def outer(self, variable, z, a_fn, dz_fn=None):
        """Records ``grad_i = sum_t a_it (outer) g_it`` with ``a = a_fn()`` (B, T, d) and
        ``g = dz_fn(dz)`` (B, T, p; default ``rows(dz)``), ``dz`` the gradient at ``z``."""
        self.add(variable, OuterTerm(z, a_fn, dz_fn))

    def embedding(self, variable, z, ids):
        """Records that rows ``ids[i, t]`` of ``variable`` receive ``dz[i, t]`` (``z`` is the
        gathered rows)."""
        self.add(variable, EmbeddingTerm(z, ids))

    def direct(self, variable, z, grad_fn):
        """Records a per-example gradient ``grad_fn(dz)`` (B, *variable.shape)."""
        self.add(variable, DirectTerm(z, grad_fn))

    def add(self, variable, term):
        self._entries.append((variable, term))

    # -- for the private step --------------------------------------------------------------

    def terms(self):
        """{id(variable): (variable, [terms])} over everything recorded."""
        out = {}
        for variable, term in self._entries:
            out.setdefault(id(variable), (variable, []))[1].append(term)
        return out

    def outputs(self):
        """The distinct recorded outputs ``z``."""
        seen, out = set(), []
        for _, term in self._entries:
            if id(term.z) not in seen:
                seen.add(id(term.z))
                out.append(term.z)
        return out

    def _run(self, layer, rule, bound, args, kwargs):
        """Runs ``rule`` for one call of ``layer``; its own call if the rule declines or
        fails (its terms are then discarded)."""
        mark, checks = len(self._entries), len(self._leading)
        self._read.append([])
        try:
            out = rule(layer, self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure falls back, never crashes
            _LOG.warning("tf_dp: the ghost rule for layer %r (%s) failed (%s: %s); its weights "
                         "get exact per-example gradients from the vectorized fallback.",
                         layer.name, type(layer).__name__, type(err).__name__, err)
            out = NotImplemented
        finally:
            read = self._read.pop()
        if out is NotImplemented:
            del self._entries[mark:]
            del self._leading[checks:]  # the layer's own call needs no per-example structure
            return bound(*args, **kwargs)
        recorded = {id(v) for v, _ in self._entries[mark:]}
        for v in read:
            if id(v) not in recorded:
                # Read inside the rule but described by no term: mark it as used outside.
                self._entries.append((v, _Untracked(tf.constant(0.0))))
        return out


class _Untracked(DirectTerm):
    """A use no term describes: the weight goes to the vectorized fallback."""

    def __init__(self, z):
        super().__init__(z, None)


def _batch_msg(layer, got, want):
    return (f"Layer {layer.name!r} was called on a tensor whose leading axis ({got}) is not the "
            f"batch ({want}); per-example norms by layer formulas need the batch axis first. "
            "Compile the DP optimizer with norm_strategy='vectorized' for this model.")


_OPAQUE_PARENTS = (keras.layers.RNN, keras.layers.Bidirectional, keras.layers.TimeDistributed,
                   keras.layers.Wrapper)


def capturable_layers(model):
    """Layers with a rule reachable without passing through a batch-reshaping wrapper."""
    out, seen = [], set()

    def visit(layer, top):
        if not top and rule_for(layer) is not None:
            if id(layer) not in seen:  # a shared layer is reachable twice
                seen.add(id(layer))
                out.append(layer)
            return
        if isinstance(layer, keras.layers.Bidirectional):
            # Calls its two RNNs on the batch-first input: both can be captured.
            visit(layer.forward_layer, False)
            visit(layer.backward_layer, False)
            return
        if not top and isinstance(layer, _OPAQUE_PARENTS):
            return
        for sub in _internals.sublayers(layer):
            visit(sub, False)

    visit(model, True)
    return out


@contextlib.contextmanager
def capture(layers, batch_size, tape=None):
    """Within the context, calls of ``layers`` run their rules into the yielded context.

    ``tape``: the ``tf.GradientTape`` recording the forward pass (rules' weight reads are
    watched on it, see ``GhostContext.read``)."""
    ctx = GhostContext(batch_size, tape)
    patched = []
    try:
        for layer in layers:
            original = layer.__dict__.get("call")
            bound = layer.call

            def call(*args, _layer=layer, _rule=rule_for(layer), _bound=bound, **kwargs):
                return ctx._run(_layer, _rule, _bound, args, kwargs)

            layer.call = call
            patched.append((layer, original))
        yield ctx
        ctx.finish()
    finally:
        for layer, original in patched:
            if original is None:
                del layer.call
            else:
                layer.call = original


__all__ = ["GhostContext", "capturable_layers", "capture", "rows"]
