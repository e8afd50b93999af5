"""The one place tf_dp touches private Keras / TensorFlow names.

Everything else in tf_dp uses public API. Each entry says why the private name is needed and
what public API would replace it; when Keras changes one of them, this file is the only one
to edit (and ``scripts/keras_range.sh`` the check that finds out, at both ends of the
supported Keras range stated in setup.py).

Not expressible as a function here: ``tf_dp.keras.dp_model.DPTrainMixin`` overrides Keras'
private ``Trainer._maybe_symbolic_build`` (Keras averages a peeked distributed batch over
replicas, which fails for Poisson batches that do not split evenly, and under
MultiWorkerMirroredStrategy; no public hook).
"""

from __future__ import annotations

import tensorflow as tf


def all_layers(layer, include_self: bool = True) -> list:
    """Every layer nested in ``layer`` (depth first), each once.

    Private: ``Layer._flatten_layers``. Public replacement: none for arbitrary layers
    (``Model.layers`` lists the top level only).
    """
    return list(layer._flatten_layers(include_self=include_self, recursive=True))


def sublayers(layer) -> list:
    """The layers directly tracked by ``layer`` (its attributes that are layers).

    Private: ``Layer._flatten_layers(recursive=False)``. Public replacement: none.
    """
    return list(layer._flatten_layers(include_self=False, recursive=False))


def seed_generators(layer) -> list:
    """The ``keras.random.SeedGenerator``s a layer owns (dropout and other random layers),
    replayed so that several passes of one step see the same random masks.

    Private: ``Layer._seed_generators``. Public replacement: none (a layer's generators are
    not listed by ``layer.variables`` as generators).
    """
    return list(getattr(layer, "_seed_generators", None) or [])


def global_seed_generator():
    """The generator unseeded ``keras.random`` calls draw from (None if not created yet).

    Private: ``keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR`` in Keras' global
    state. Public replacement: none.
    """
    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
    except ImportError:  # pragma: no cover - moved in a future Keras
        return None
    # The constant exists from Keras 3.13; 3.12 uses the same string literally.
    key = getattr(seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator")
    return global_state.get_global_attribute(key)


def added_losses(layer) -> list:
    """Losses the layer added in its last call (``add_loss``, activity regularisers),
    without the weight regularisers ``layer.losses`` also lists.

    Private: ``Layer._losses``. Public replacement: none separates the two.
    """
    return list(getattr(layer, "_losses", None) or [])


def loss_tracker(model):
    """The ``keras.metrics.Mean`` behind the "loss" entry of the training logs.

    Private: ``Trainer._loss_tracker``. Public replacement: none (``compute_loss`` updates it
    with a scalar loss of the whole batch, which the private step never forms).
    """
    return model._loss_tracker


def compile_loss(model):
    """Keras' compiled loss (a ``CompileLoss``), whose metrics are the per-output losses
    ("a_loss", ...) of a multi-output model; None before ``compile``.

    Private: ``Trainer._compile_loss``. Public replacement: none (``model.compute_loss``
    updates them too, but also the "loss" tracker, with a loss the private step never forms).
    """
    return getattr(model, "_compile_loss", None)


def causal_padding(layer):
    """The padding of a ``padding="causal"`` Conv1D, as a ``tf.pad`` argument.

    Private: ``BaseConv._compute_causal_padding``. Public replacement: none.
    """
    return layer._compute_causal_padding()


def reshape_into_groups(layer, x):
    """``x`` reshaped by a ``GroupNormalization`` into (..., groups, channels per group).

    Private: ``GroupNormalization._reshape_into_groups``. Public replacement: none (the
    reshape is simple, but reusing Keras' keeps the rule exactly the layer's own).
    """
    return layer._reshape_into_groups(x)


def analyze_einsum_string(equation, bias_axes, input_shape, output_shape):
    """Kernel and bias shapes of an ``EinsumDense`` equation (what its ``build`` uses).

    Private: ``keras.src.layers.core.einsum_dense._analyze_einsum_string``. Public
    replacement: build a throw-away ``keras.layers.EinsumDense`` and read its weights'
    shapes (slower; creates variables).
    """
    from keras.src.layers.core.einsum_dense import _analyze_einsum_string

    return _analyze_einsum_string(equation, bias_axes, input_shape, output_shape)


def conv_output_shape(input_shape, filters, kernel_size, strides, padding, data_format,
                      dilation_rate):
    """The output shape of a convolution (what Keras' ``Conv`` layers compute).

    Private: ``keras.src.ops.operation_utils.compute_conv_output_shape``. Public
    replacement: ``keras.ops.conv`` on a ``keras.KerasTensor`` (needs a kernel tensor).
    """
    from keras.src.ops.operation_utils import compute_conv_output_shape

    return compute_conv_output_shape(input_shape, filters, kernel_size, strides=strides,
                                     padding=padding, data_format=data_format,
                                     dilation_rate=dilation_rate)


def is_functional(model) -> bool:
    """True for a model built as ``keras.Model(inputs, outputs)`` (not subclassed).

    Private: ``keras.src.models.functional.Functional``. Public replacement: none
    (``keras.Model(...)`` returns that class; it is not exported).
    """
    from keras.src.models.functional import Functional

    return type(model) is Functional


def functional_class():
    """``keras.src.models.functional.Functional`` (see ``is_functional``)."""
    from keras.src.models.functional import Functional

    return Functional


def give_class(obj, cls) -> None:
    """Re-classes ``obj`` as ``cls`` (a subclass of its own class, adding no state).

    Used by ``tf_dp.keras.make_private`` for subclassed models, whose ``call`` and state
    cannot be rebuilt from a config. Not a private name, but outside Keras' public contract;
    public replacement: subclass ``tf_dp.keras.DPModel`` instead of ``keras.Model``.
    """
    if not issubclass(cls, type(obj)):
        raise TypeError(f"{cls.__name__} is not a subclass of {type(obj).__name__}.")
    obj.__class__ = cls


__all__ = ["added_losses", "all_layers", "analyze_einsum_string", "causal_padding", "compile_loss",
           "conv_output_shape", "functional_class", "give_class", "global_seed_generator",
           "is_functional", "loss_tracker", "reshape_into_groups", "seed_generators",
           "sublayers"]


# ------------------------------------------------------------------ tf.distribute


def in_multi_worker_mode(strategy) -> bool:
    """True for a MultiWorkerMirroredStrategy with more than one worker (no public API tells
    a one-worker MultiWorkerMirroredStrategy from a real cluster)."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def worker_input_context(strategy):
    """The `tf.distribute.InputContext` `distribute_datasets_from_function` gives this
    worker's input pipeline (pipeline id = worker id, number of pipelines = of workers)."""
    return strategy.extended._make_input_context()


def num_workers(strategy) -> int:
    """Workers (processes) of a multi-worker strategy; 1 for every other strategy (public
    API has only the cluster spec, which counts a chief and evaluators differently)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    return max(1, int(getattr(strategy.extended, "_num_workers", 1)))


def compiling_with_xla() -> bool:
    """Whether ops made now are in a function XLA compiles (``jit_compile=True``, also
    nested), where some TensorFlow kernels (e.g. EuclideanNorm) do not exist."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util  # no public equivalent

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


#: op types that run Python code TensorFlow cannot see into (tf.py_function, numpy_function)
PYTHON_OPS = ("EagerPyFunc", "PyFunc", "PyFuncStateless")


def xla_marked(graph, operations) -> tuple:
    """What in ``operations`` (of ``graph``, a graph being traced), or in the functions they
    call (branches, loop bodies, nested calls) at any depth, TensorFlow runs outside its own
    kernels: ``(xla, python)``, two lists of op names.

    ``xla``: ops marked ``_XlaCompile`` (``jit_scope``), calls of functions marked
    ``_XlaMustCompile`` (``tf.function(jit_compile=True)``; named ``"caller -> function"``)
    and XLA-only ops (types ``Xla*``, e.g. jax2tf's ``XlaCallModule``). ``python``: ops
    running Python code (``PYTHON_OPS``), which may do anything, XLA included.

    Private: ``Graph._get_function`` (the function a call op names). Public replacement:
    none while the graph is still being traced."""
    xla, python, seen = [], [], set()

    def node(name, op_type, attr):
        marked = attr.get("_XlaCompile")
        if (marked is not None and marked.b) or op_type.startswith("Xla"):
            xla.append(name)
        if op_type in PYTHON_OPS:
            python.append(name)
        for value in attr.values():
            names = [value.func.name] if value.HasField("func") else (
                [f.name for f in value.list.func] if value.HasField("list") else [])
            for fname in names:
                function(fname, name)

    def function(name, caller):
        if name in seen:
            return
        seen.add(name)
        fn = graph._get_function(name)
        if fn is None:
            return
        definition = getattr(fn, "cached_definition", None) or fn.definition
        must = definition.attr.get("_XlaMustCompile")
        if must is not None and must.b:
            xla.append(f"{caller} -> {name}")
        for nd in definition.node_def:
            node(nd.name, nd.op, nd.attr)

    for op in operations:
        node(op.name, op.type, op.node_def.attr)
    return xla, python


_PFOR_LOCK = __import__("threading").Lock()
_PFOR_DEPTH = [0]
_PFOR_SAVED: dict = {}


def pfor_converters(overrides: dict):
    """A context manager under which ``tf.vectorized_map`` converts the op types in
    ``overrides`` with ``overrides[op_type](pfor_input, original)``: ``original`` is
    TensorFlow's own converter, which an override calls for the cases it does not take.
    Nested and concurrent uses (replicas tracing in threads) share one installation,
    removed when the last one exits, so TensorFlow's converters are always restored.
    ``pfor_input`` has the private ``_PforInput`` API (``stacked_input``, ``get_attr``,
    ...); return ``wrap(tensor)`` of a stacked (per-iteration) result.

    Private: ``parallel_for.pfor._pfor_converter_registry``. Public replacement: none
    (pfor's converters are registered once, at import; no hook per call).
    """
    import contextlib

    from tensorflow.python.ops.parallel_for import pfor

    registry = pfor._pfor_converter_registry

    @contextlib.contextmanager
    def installed():
        with _PFOR_LOCK:
            if _PFOR_DEPTH[0] == 0:
                for op_type, fn in overrides.items():
                    original = registry.get(op_type)
                    if original is None:
                        continue
                    _PFOR_SAVED[op_type] = original
                    registry[op_type] = (
                        lambda pfor_input, fn=fn, original=original: fn(pfor_input, original))
            _PFOR_DEPTH[0] += 1
        try:
            yield
        finally:
            with _PFOR_LOCK:
                _PFOR_DEPTH[0] -= 1
                if _PFOR_DEPTH[0] == 0:
                    registry.update(_PFOR_SAVED)
                    _PFOR_SAVED.clear()

    return installed()


def pfor_wrap(tensor):
    """A pfor converter's stacked (per-iteration) result. Private: ``pfor.wrap``."""
    from tensorflow.python.ops.parallel_for import pfor

    return pfor.wrap(tensor, True)
