"""The private step, stage by stage (docs/design.md has the diagram).

    sample  ->  clipped sum (NormStrategy, GradientCarrier's privatized variables)
            ->  accumulate micro-batches  ->  noise once  ->  carrier reconstruction
            ->  the inner Keras optimizer's update

This module holds the stages shared by every optimizer and loop: ``clipped_sum`` (per
example norms by the strategy, clip factors ``w_i = min(1, C/||g_i||)``, ``sum_i w_i g_i``)
and ``gaussian_noise``. The noise, the normalisation and the accounting of a step are done
once per logical step by the optimizer (``tf_dp.optimizers.DPOptimizerMixin.apply_private``);
the Keras train step (``tf_dp.keras.DPModel``) composes them.
"""

from __future__ import annotations

import functools
import numbers
import os
import threading
import time
import warnings
import weakref

import keras
import tensorflow as tf

from tf_dp import _internals
from tf_dp.core import gaussian, norm_strategies, randomness
from tf_dp.core.ghost.factors import consecutive_groups
from tf_dp.core.ghost.terms import padded_rows
from tf_dp.core.norm_strategies import (  # noqa: F401
    ClippedSum, batch_size_of, clip_factors, real_rows)


def check_no_cross_example_layers(model):
    """Refuses trainable BatchNormalization (its batch statistics mix examples), stateful
    recurrent layers (their states carry one step's examples into the next step) and a
    ``TextVectorization`` that pads each batch to its own longest text (one example sets
    the length every other is computed at). By the layers' configuration alone, never the
    data."""
    for layer in _internals.all_layers(model, include_self=False):
        if (isinstance(layer, keras.layers.TextVectorization)
                and getattr(layer, "_output_mode", None) == "int"
                and getattr(layer, "_output_sequence_length", None) is None
                and not getattr(layer, "_ragged", False)):
            raise ValueError(
                f"Layer {layer.name!r} is a TextVectorization with output_sequence_length="
                "None: it pads each batch to the length of its longest text, so one example "
                "sets the length at which every other example of its batch is computed (one "
                "example moved the clipped sum by 2.41 times the clipping norm, session 25 "
                "audit). Give it output_sequence_length=<a fixed length> (with "
                "Embedding(mask_zero=True) to mask the padding).")
        if isinstance(layer, keras.layers.RNN) and getattr(layer, "stateful", False):
            raise ValueError(
                f"Layer {layer.name!r} is a stateful recurrent layer (stateful=True): its "
                "states carry the examples of one batch into the next batch's outputs, so an "
                "example influences steps it was not sampled for and its contribution is not "
                "bounded by the clipping norm; its states would also be saved with the model "
                "without noise. Use stateful=False (the default).")
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"Layer {layer.name!r} is a BatchNormalization layer: its batch statistics mix "
                "examples, so per-example gradients (and differential privacy) are undefined. "
                "Use keras.layers.GroupNormalization or LayerNormalization, or freeze it "
                "(layer.trainable = False).")


#: Environment variables that let oneDNN compute float32 matrix products and convolutions
#: with a lower-precision internal type (bfloat16, float16, TF32 ...). TensorFlow reads the
#: first once ("BF16" sets oneDNN's default fpmath mode); oneDNN reads the second itself.
_REDUCED_PRECISION_MATH_VARIABLES = ("TF_SET_ONEDNN_FPMATH_MODE", "ONEDNN_DEFAULT_FPMATH_MODE",
                                     "DNNL_DEFAULT_FPMATH_MODE")


@functools.lru_cache(maxsize=1)
def _process_start_environment() -> dict:
    """The environment the process was started with (Linux: ``/proc/self/environ``, which
    later ``os.environ`` changes do not touch); empty where it cannot be read. Read once: it
    never changes (the checks below run at every eager step)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


#: The variables as they were when tf_dp's private step was first imported.
_AT_IMPORT = {name: os.environ.get(name)
              for name in _REDUCED_PRECISION_MATH_VARIABLES + ("TF_XLA_FLAGS",)}


def _values_in_this_process(name):
    """``(when, value)`` of the environment variable ``name`` now, when tf_dp was imported
    and when the process started: TensorFlow and oneDNN read such settings once per
    process, so any of the three may be the one in force."""
    return (("is set", os.environ.get(name)),
            ("was set when tf_dp was imported", _AT_IMPORT.get(name)),
            ("was set when this process started", _process_start_environment().get(name)))


def _reduced_precision(value) -> bool:
    return bool(value and value.strip() and value.strip().upper() != "STRICT")


def mixed_precision_rewrite_setting() -> str:
    """Which of Grappler's automatic mixed precision rewrites is on ("" if none):
    ``auto_mixed_precision`` (float16 on a GPU), ``auto_mixed_precision_onednn_bfloat16``
    or ``auto_mixed_precision_mkl`` (bfloat16 on this CPU), any option of that name."""
    try:
        options = tf.config.optimizer.get_experimental_options()
    except (AttributeError, ValueError):  # pragma: no cover - an older TensorFlow
        return ""
    on = sorted(k for k, v in options.items() if k.startswith("auto_mixed_precision") and v)
    return ", ".join(f"{k}=True" for k in on)


@functools.lru_cache(maxsize=1)
def _tf32_capable_gpus() -> tuple:
    """The visible GPUs whose float32 matrix products and convolutions TensorFloat-32 can
    run (compute capability 8.0 and above, Ampere on; an unknown capability counts), as
    descriptions. Physical devices do not change within a process: read once."""
    out = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            capability = tf.config.experimental.get_device_details(device).get(
                "compute_capability")
        except (ValueError, RuntimeError):  # pragma: no cover - no details
            capability = None
        if capability is None or tuple(capability) >= (8, 0):
            out.append(f"{device.name} (compute capability "
                       f"{'unknown' if capability is None else '%d.%d' % tuple(capability)})")
    return tuple(out)


def tensor_float_32_setting() -> str:
    """How TensorFloat-32 reaches the private step ("" if it does not): TensorFlow's TF32
    execution is on (its default) and a visible GPU can use it."""
    from tensorflow.python.framework import config  # noqa: PLC0415

    gpus = _tf32_capable_gpus()
    if not gpus or not config.tensor_float_32_execution_enabled():
        return ""
    return f"TensorFloat-32 execution on {', '.join(gpus)}"


def check_exact_float_arithmetic():
    """Refuses a private step when oneDNN may compute float32 in lower precision.

    Every clip bound rests on worst-case rounding bounds of float32 arithmetic (u = 2^-24:
    the per-example gradients, their weighted sums, docs/privacy.md "The clip bound holds
    for any input and precision"). With oneDNN's fpmath mode set to bfloat16 (16 times
    the relative error, per operation), a weighted sum could add more than C for an example,
    and the printed epsilon would not hold.

    TensorFlow and oneDNN read these variables once, when their first kernel needs them,
    and keep the value for the life of the process: unsetting one afterwards changes
    nothing. So a variable counts if it is set now, was set when tf_dp was imported, or was
    set when the process started; the only fix is to start a new process without it (or
    with "STRICT"). Not caught: a variable set and unset again by the program itself
    between two of those moments, while a kernel read it (docs/privacy.md).
    """
    rewrite = mixed_precision_rewrite_setting()
    _note_setting(MIXED_PRECISION_REWRITE, rewrite)
    if rewrite:
        raise ValueError(
            f"Grappler's automatic mixed precision is on ({rewrite}): it rewrites float32 "
            "products and convolutions of the private step to a 16-bit type, which breaks "
            "the rounding bounds that keep every example's clipped contribution within the "
            "clipping norm (so the reported epsilon would not hold; per-example norms moved "
            "by up to 12.6 % under it, session 24 audit). Turn it off "
            "(tf.config.optimizer.set_experimental_options({'<option>': False})); for mixed "
            "precision, use a Keras dtype policy, which tf_dp's bounds cover.")
    tf32 = tensor_float_32_setting()
    _note_setting(TENSOR_FLOAT_32, tf32)
    if tf32:
        raise ValueError(
            f"{tf32} is on (TensorFlow's default): it runs float32 products and "
            "convolutions with 10-bit mantissas, which breaks the rounding bounds that keep "
            "every example's clipped contribution within the clipping norm (so the reported "
            "epsilon would not hold). Turn it off before training: "
            "tf.config.experimental.enable_tensor_float_32_execution(False).")
    for name in _REDUCED_PRECISION_MATH_VARIABLES:
        for when, value in _values_in_this_process(name):
            if _reduced_precision(value):
                raise ValueError(
                    f"The environment variable {name}={value!r} {when}: it lets oneDNN "
                    "compute float32 products and convolutions in a lower precision, which "
                    "breaks the rounding bounds that keep every example's clipped "
                    "contribution within the clipping norm (so the reported epsilon would "
                    "not hold). TensorFlow and oneDNN read it once per process, so "
                    "unsetting it now does not help: start a new process without it (or "
                    "with it set to 'STRICT').")


def _auto_clustering_flags(flags, _depth=0) -> str:
    """What in a TF_XLA_FLAGS value turns XLA auto-clustering on, or may ("" if nothing):
    ``--tf_xla_auto_jit`` other than 0 or -1; ``--tf_xla_cpu_global_jit`` (on the CPU,
    with it ``set_jit`` takes effect however late it is called: session 24 audit, 12.3 C
    in a loop traced before); a value that is not flags, which XLA reads as the name of a
    flags file (its flags count; a file that cannot be read, too: session 24 audit, 2.89 C
    from a file's --tf_xla_auto_jit=2)."""
    flags = (flags or "").strip()
    if not flags:
        return ""
    if not flags.startswith("-"):
        if _depth:
            return f"a flags file naming another ({flags!r})"
        try:
            with open(flags, encoding="utf-8", errors="replace") as f:
                inner = f.read()
        except OSError:
            return f"the flags file {flags!r}, which tf_dp cannot read"
        found = _auto_clustering_flags(inner, _depth + 1)
        return f"{found} in the flags file {flags!r}" if found else ""
    for part in flags.replace("\n", " ").split():
        name, _, value = part.partition("=")
        value = value.strip()
        if name == "--tf_xla_auto_jit" and value not in ("", "0", "-1"):
            return part
        if name == "--tf_xla_cpu_global_jit" and value.lower() not in ("false", "0"):
            return part
    return ""


def _parsed_xla_flags() -> str:
    """What TensorFlow itself parsed from TF_XLA_FLAGS ("" if nothing turns auto-clustering
    on): the variable can be set before TensorFlow reads it and unset before tf_dp looks
    (session 24 review: 2.89 C through train_on_batch, the environment clean at all three
    moments tf_dp read it)."""
    try:
        from tensorflow.python.client import pywrap_tf_session as c_api  # noqa: PLC0415

        if c_api.TF_GetXlaAutoJitEnabled():
            return "TensorFlow's parsed TF_XLA_FLAGS with --tf_xla_auto_jit on"
        # No getter: setting returns the previous value, which is put back at once.
        previous = c_api.TF_SetTfXlaCpuGlobalJit(0)
        c_api.TF_SetTfXlaCpuGlobalJit(previous)
        if previous:
            return "TensorFlow's parsed TF_XLA_FLAGS with --tf_xla_cpu_global_jit"
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other builds
        return ""
    return ""


def xla_auto_clustering_setting() -> str:
    """How XLA auto-clustering is on in this process ("" if it is not): ``set_jit``, the
    flags TensorFlow parsed, or TF_XLA_FLAGS now, at tf_dp's import or at the process's start
    (``_auto_clustering_flags``)."""
    try:
        jit = tf.config.optimizer.get_jit()
    except (AttributeError, ValueError):  # pragma: no cover - an older TensorFlow
        jit = ""
    if jit and str(jit).lower() not in ("false", "0", "off"):
        return f"tf.config.optimizer.get_jit() = {jit!r}"
    parsed = _parsed_xla_flags()
    if parsed:
        return parsed
    for when, value in _values_in_this_process("TF_XLA_FLAGS"):
        flag = _auto_clustering_flags(value)
        if flag:
            return f"TF_XLA_FLAGS {when} with {flag}"
    return ""


# ------------------------------------------------------ settings on at some time (latched)

#: kind -> list of [start, end or None] (time.monotonic) while that setting was on, as far as
#: tf_dp saw: the wrapped setters (``_install_setting_latches``) and every check. A budget
#: voids the steps it reads when one of these overlaps the time since it last read that
#: ledger (``settings_on_since``).
_SETTING_INTERVALS = {}
_SETTING_LOCK = threading.Lock()

#: the kinds of ``_SETTING_INTERVALS`` (budget.py has a caveat for each)
AUTO_CLUSTERING, MIXED_PRECISION_REWRITE = "auto_clustering", "mixed_precision_rewrite"
TENSOR_FLOAT_32 = "tensor_float_32"


def _note_setting(kind, detail):
    """Records that setting ``kind`` is on now (``detail``, how) or off ("")."""
    now = time.monotonic()
    with _SETTING_LOCK:
        intervals = _SETTING_INTERVALS.setdefault(kind, [])
        open_ = intervals and intervals[-1][1] is None
        if detail and not open_:
            intervals.append([now, None, detail])
        elif not detail and open_:
            intervals[-1][1] = now


def settings_on_since(start) -> dict:
    """{kind: detail} of the settings on at some time after ``start`` (time.monotonic), or
    on now. Checks the current ones first."""
    _note_setting(AUTO_CLUSTERING, xla_auto_clustering_setting())
    _note_setting(MIXED_PRECISION_REWRITE, mixed_precision_rewrite_setting())
    _note_setting(TENSOR_FLOAT_32, tensor_float_32_setting())
    with _SETTING_LOCK:
        out = {}
        for kind, intervals in _SETTING_INTERVALS.items():
            for begin, end, detail in intervals:
                if end is None or end > start:
                    out[kind] = detail
        return out


#: held around each wrapped setter's call and its note, so that the value noted is the one
#: that call left: two threads setting on and off could otherwise note "off" twice and lose
#: the window in between (session 25 review, reasoning only)
_SETTERS_LOCK = threading.RLock()


def _install_setting_latches():
    """Wraps TensorFlow's eager context where ``set_jit`` and ``set_experimental_options``
    store their values (the ``optimizer_jit`` setter, ``set_optimizer_experimental_options``),
    so that tf_dp sees every time auto-clustering or a mixed precision rewrite is turned on
    or off, also between two reads of a custom loop's steps (session 24 review: turned on
    for three steps and off before the report, 7.31 C with no caveat). Every public route
    ends there: ``tf.config.optimizer``, its ``tf.compat.v1`` and ``tf.compat.v2`` aliases
    (separate module objects, which a wrapper on ``tf.config.optimizer`` missed: session 25
    audit) and ``tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite``. The
    wrapped methods behave as TensorFlow's."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    cls = context.Context
    prop = cls.__dict__.get("optimizer_jit")
    if isinstance(prop, property) and prop.fset is not None and not getattr(
            prop.fset, "_tf_dp_latch", False):
        def set_jit(self, enabled, _original=prop.fset):
            with _SETTERS_LOCK:
                _original(self, enabled)
                _note_setting(AUTO_CLUSTERING, xla_auto_clustering_setting())

        set_jit._tf_dp_latch = True
        setattr(cls, "optimizer_jit", property(prop.fget, set_jit, prop.fdel, prop.__doc__))
    original = cls.__dict__.get("set_optimizer_experimental_options")
    if original is not None and not getattr(original, "_tf_dp_latch", False):
        def set_options(self, options, _original=original):
            with _SETTERS_LOCK:
                out = _original(self, options)
                _note_setting(MIXED_PRECISION_REWRITE, mixed_precision_rewrite_setting())
            return out

        functools.update_wrapper(set_options, original)
        set_options._tf_dp_latch = True
        setattr(cls, "set_optimizer_experimental_options", set_options)
    # TensorFloat-32: every route (tf.config.experimental.enable_tensor_float_32_execution
    # and its aliases) calls this module's enable.
    from tensorflow.python.framework import config  # noqa: PLC0415

    pywrap = getattr(config, "_pywrap_tensor_float_32_execution", None)
    enable = getattr(pywrap, "enable", None)
    if enable is not None and not getattr(enable, "_tf_dp_latch", False):
        def enable_tf32(enabled, _original=enable):
            with _SETTERS_LOCK:
                out = _original(enabled)
                _note_setting(TENSOR_FLOAT_32, tensor_float_32_setting())
            return out

        enable_tf32._tf_dp_latch = True
        try:
            pywrap.enable = enable_tf32
        except (AttributeError, TypeError):  # pragma: no cover - a read-only module
            pass


_install_setting_latches()

_OWN_STEP = threading.local()


class own_train_step:
    """While tf_dp's Keras train step traces (this thread): it handles XLA's batch shapes
    itself (``XLA_BATCH_SHAPES`` where they follow the data, padding where fit draws them)."""

    def __enter__(self):
        _OWN_STEP.depth = getattr(_OWN_STEP, "depth", 0) + 1

    def __exit__(self, *exc):
        _OWN_STEP.depth -= 1
        return False


#: the caveat of a private model whose sums were traced under XLA outside its train step
XLA_CUSTOM_SUMS_DETAIL = "tf_dp.core.clipped_sum traced under XLA outside tf_dp's train step"


def _note_xla_outside_own_step(model, variables):
    """A ``clipped_sum`` traced under XLA by code other than tf_dp's train step (a custom
    loop under the user's ``jit_compile=True``): its batch shapes are unknown to tf_dp, and
    the sums may reach ``apply_private`` through another function, outside XLA (session 24
    review: 1.33 C with no caveat). A private model's budget carries the voiding caveat;
    and ``apply_private`` notes it for the steps of these variables
    (``sums_formed_under_xla``), whatever model they belong to."""
    if not _internals.compiling_with_xla() or getattr(_OWN_STEP, "depth", 0):
        return
    with _SETTING_LOCK:
        for v in variables:
            _XLA_SUM_VARIABLES[id(v)] = weakref.ref(v)
    caveat = getattr(model, "_dp_caveat", None)
    if caveat is not None:
        from tf_dp.keras.budget import XLA_CUSTOM_SUMS_CAVEAT  # noqa: PLC0415 (a cycle)

        caveat(XLA_CUSTOM_SUMS_CAVEAT.format(setting=XLA_CUSTOM_SUMS_DETAIL))


#: id -> weak reference of the variables whose clipped sums were traced under XLA outside
#: tf_dp's train step (Keras variables are not hashable)
_XLA_SUM_VARIABLES = {}


def sums_formed_under_xla(variables) -> bool:
    """Whether ``clipped_sum`` was traced under XLA, outside tf_dp's train step, for any of
    ``variables`` (``_note_xla_outside_own_step``)."""
    with _SETTING_LOCK:
        return any(_XLA_SUM_VARIABLES.get(id(v), lambda: None)() is v for v in variables)


def check_no_jit_scope(where="a private step"):
    """Refuses ``where`` traced inside ``tf.xla.experimental.jit_scope()``.

    The scope marks the ops created in it for XLA compilation (``_XlaCompile``), and
    TensorFlow compiles them in clusters on this CPU with no flag or setting: tf_dp sees
    neither ``jit_compile`` nor auto-clustering, so neither pads the batches to one shape
    nor reports ``XLA_BATCH_SHAPES``, while XLA's kernels round a row differently for
    different batch sizes (session 25 audit: the clipped sums' norms, products and sums
    compiled in 19 clusters, no refusal, no caveat). ``compile(jit_compile=True)`` is the
    supported route."""
    from tensorflow.python.framework import ops  # noqa: PLC0415

    if tf.executing_eagerly():
        return
    scope = getattr(ops.get_default_graph(), "_attr_scope_map", None) or {}
    marked = scope.get("_XlaCompile")
    # A bool AttrValue, or (jit_scope(compile_ops=<callable>)) a function TensorFlow calls
    # per op: refused whatever it answers (session 25 review: a callable passed).
    if marked is not None and (callable(marked) or getattr(marked, "b", False)):
        raise ValueError(
            f"tf_dp: {where} is traced inside tf.xla.experimental.jit_scope(), which has "
            "TensorFlow compile its ops with XLA in clusters tf_dp cannot see: XLA's kernels "
            "round an example's terms differently for different batch sizes, so one example "
            "could move the update by more than l2_norm_clip, and tf_dp would neither pad "
            "the batches to one shape nor report it. Take the private step out of the "
            "jit_scope; for XLA, use model.compile(jit_compile=True).")


def traced_ops():
    """The graph being traced and how many ops it has now (``check_no_xla_inside``'s start);
    None eagerly or under XLA (``jit_compile``: the whole step is compiled, and tf_dp pads or
    reports it)."""
    if tf.executing_eagerly() or _internals.compiling_with_xla():
        return None
    graph = tf.compat.v1.get_default_graph()
    return graph, len(graph.get_operations())


#: the voiding caveat of a private step that runs Python code (tf.py_function)
PYTHON_CODE_CAVEAT = (
    "OPAQUE_PYTHON: the private step runs Python code through tf.py_function or "
    "tf.numpy_function, which TensorFlow and tf_dp cannot see into: it may compile "
    "with XLA for each batch shape, keep state from one example for another, or round an "
    "example's gradient by the batch. Move it out of the model and the loss (into the "
    "tf.data pipeline, which runs before the private step) or write it with TensorFlow ops.")


def _first_names(names, k):
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def check_no_xla_inside(start, where="the private step", model=None):
    """Refuses ops made since ``start`` (``traced_ops()``) that TensorFlow compiles with XLA
    on its own: a ``jit_scope``, a ``tf.function(jit_compile=True)`` or an XLA-only op
    (``XlaCallModule``) inside the model's layers or the loss, which ``check_no_jit_scope``
    at the top of ``clipped_sum`` cannot see (session 26 audit: a layer's ``call`` under a
    ``jit_scope`` ran 9 steps with "Compiled cluster using XLA!" logged and the report
    saying the guarantee holds; XLA's ``tanh`` rounded 16 of 16 rows differently at 16 and
    32 rows, where TensorFlow's own kernel rounded none). Python code among them
    (``tf.py_function``) warns and gives ``model`` the voiding caveat ``OPAQUE_PYTHON``."""
    if start is None:
        return
    graph, first = start
    marked, python = _internals.xla_marked(graph, graph.get_operations()[first:])
    if python:
        # Python code in the step (tf.py_function): whatever it does is unseen (session 26
        # review: XLA run inside it rounded 16 of 16 examples' norms differently at 16 and
        # 32 rows, with the guarantee reported as holding). Not refused (it is also how
        # code records what a step saw), but the report no longer says the guarantee holds.
        shown = _first_names(python, 3)
        caveat = getattr(model, "_dp_caveat", None)
        if caveat is not None:
            caveat(PYTHON_CODE_CAVEAT)
        warnings.warn(f"tf_dp: {PYTHON_CODE_CAVEAT} (ops: {shown})", stacklevel=2)
    if marked:
        raise ValueError(
            f"tf_dp: {where} has TensorFlow compile ops with XLA on its own "
            f"({_first_names(marked, 5)}): a tf.xla.experimental.jit_scope(), a "
            "tf.function(jit_compile=True) or an XLA-only op (XlaCallModule, as jax2tf "
            "makes) inside the model's layers or the loss. XLA's kernels round an example's "
            "terms differently for different batch sizes, so one example could move the "
            "update by more than l2_norm_clip, and tf_dp would neither pad the batches to "
            "one shape nor report it. Remove it from the model and the loss; for XLA, use "
            "model.compile(jit_compile=True), which compiles the whole private step.")


def check_no_xla_auto_clustering():
    """Refuses a private step while XLA auto-clustering is on.

    Auto-clustering (``tf.config.optimizer.set_jit("autoclustering")``, or TF_XLA_FLAGS'
    ``--tf_xla_auto_jit``) compiles clusters of the step with XLA for each shape it meets,
    without ``jit_compile``: tf_dp cannot see it (``compiling_with_xla`` is False), so it
    neither pads the batches to one shape nor reports ``XLA_BATCH_SHAPES``. XLA's kernels
    round a row differently for different batch sizes, and through ``train_on_batch`` one
    example moved the clipped sum by 28.6 C (a custom RNN cell) and 36.3 C (LSTM) past
    crafted examples (session 23 review). Use ``model.compile(jit_compile=True)`` instead,
    with which ``fit`` pads every batch to one shape. TensorFlow reads TF_XLA_FLAGS once per
    process: it counts if set now, at tf_dp's import or at the process's start.

    Checked while a step is traced, at every call of a Keras train function of a private
    model, and whenever a budget reads steps (``XLA_AUTO_CLUSTERING`` voids the report
    then): ``set_jit`` called after the step was traced still reaches it (session 24
    audit)."""
    setting = xla_auto_clustering_setting()
    _note_setting(AUTO_CLUSTERING, setting)
    if setting:
        raise ValueError(
            f"XLA auto-clustering is on ({setting}): it compiles parts of the private step "
            "for each batch shape, whose kernels round an example's gradient differently "
            "for different batch sizes, so one example could move the clipped sum by more "
            "than l2_norm_clip. Turn it off (tf.config.optimizer.set_jit(False); "
            "TensorFlow reads TF_XLA_FLAGS once per process: start a new process without "
            "it) and use model.compile(jit_compile=True), with which fit pads every batch "
            "to one shape.")


def non_finite_policy(model):
    """How ``clip_factors`` treats non-finite per-example gradients of ``model``: "zero",
    always (since session 16).

    An example whose gradient is NaN or infinite gets the clip factor 0 and adds nothing: a
    function of that example alone, so every example's contribution stays within C. The
    "error" policy, a CheckNumerics stop, was the default without float16 and XLA until
    session 16: the stop is observable, so whoever could plant such an example learned from
    whether training stopped whether it was sampled (a release no accounting covers; under
    XLA, which drops the assertion, the example made every weight NaN instead, session 13
    audit). Its cost argument is gone: the examples are zeroed in the sums only when some
    clip bound is not finite (``norm_strategies._weighted_sums``). The logged training
    loss, outside the guarantee, still shows a non-finite loss to whoever reads it.
    ``model`` is kept for callers that pass it.
    """
    del model
    return "zero"


#: a batch of fewer rows is run padded to this many rows of sample weight 0
MIN_ROWS = 16

#: every batch runs padded to a multiple of this many rows (weight 0): a whole number of
#: SIMD packets of float32 (16 with AVX-512; 8 with AVX2) in every batch-major tensor
ROW_MULTIPLE = 16


def padded_row_count(n, min_rows=MIN_ROWS):
    """The rows a batch of ``n`` examples runs with: at least ``min_rows``, a multiple of
    ``ROW_MULTIPLE`` (``n`` a Python int or an int tensor)."""
    m = -(-int(min_rows) // ROW_MULTIPLE) * ROW_MULTIPLE
    if isinstance(n, int):
        return max(m, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)
    return tf.maximum(m, (n + ROW_MULTIPLE - 1) // ROW_MULTIPLE * ROW_MULTIPLE)


@tf.autograph.experimental.do_not_convert
def clipped_sum(model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                variables=None, norm_strategy="auto", num_projections: int = None,
                seed=None, min_rows: int = None) -> ClippedSum:
    """Clips every example's gradient to ``l2_norm_clip`` and sums them.

    Args:
      model: the Keras model.
      x, y, sample_weight: one batch; padded examples carry sample weight 0.
      per_example_loss: ``fn(y_true, y_pred, sample_weight) -> (B,)``.
      l2_norm_clip: the clipping norm C.
      variables: variables to privatize (default: ``model.trainable_variables``).
      norm_strategy: a ``tf_dp.NormStrategy`` (``Auto()``, ``Ghost()``, ``Vectorized()``,
        ``JL(r)``) or its name ("auto", "ghost", "vectorized", "jl" with
        ``num_projections``).
      seed: (2,) int seed of the JL directions (JL strategies).
      min_rows: a smaller batch runs padded to this many rows of weight 0 (default
        ``MIN_ROWS``; a micro-batch loop passes its physical batch size, which its parts
        then all have); every batch is padded to a multiple of ``ROW_MULTIPLE`` rows.

    Returns a ``ClippedSum`` whose ``grads`` are float64 whatever the variables' dtype: pass
    them to ``DPOptimizerMixin.apply_private``, which adds the float64 noise and rounds once
    (docs/privacy.md, "Sums over examples are formed in float64").
    """
    strategy = norm_strategies.get(norm_strategy, num_projections)
    check_exact_float_arithmetic()
    check_no_xla_auto_clustering()
    check_no_jit_scope("tf_dp.core.clipped_sum")
    check_no_cross_example_layers(model)
    variables = list(model.trainable_variables if variables is None else variables)
    _note_xla_outside_own_step(model, variables)
    hide = declared_unknown_dims(model, x, y, sample_weight)
    x, y, sample_weight = dynamic_batch((x, y, sample_weight), hide)
    _check_one_kind_of_trace(model, (x, y))
    n = batch_size_of(x)
    min_rows = MIN_ROWS if min_rows is None else int(min_rows)
    x, y, sample_weight = _at_least_min_rows(x, y, sample_weight, n, min_rows)
    start = traced_ops()
    try:
        out = strategy._clipped_sum(model, x, y, sample_weight, per_example_loss,
                                    l2_norm_clip, variables, seed=seed,
                                    non_finite=non_finite_policy(model))
    except (TypeError, ValueError) as error:
        note = _hidden_targets_note(x, y, hide)
        if note and type(error) in (TypeError, ValueError):
            # A new error of the same type (autograph re-creates errors raised in traced
            # code by their message, so a note added to this one would be lost).
            raise type(error)(f"{error}\n\n{note}") from error
        raise
    check_no_xla_inside(start, "tf_dp.core.clipped_sum", model)
    if isinstance(n, int) and n == padded_row_count(n, min_rows):
        return out
    real = lambda t: None if t is None else t[:n]  # noqa: E731
    return ClippedSum(grads=out.grads, losses=real(out.losses),
                      y_pred=tf.nest.map_structure(real, out.y_pred), norms=real(out.norms))


def _trace_kind(structure):
    """Which non-batch dimensions of the inputs and targets a trace knows: per tensor, its
    rank and a known/unknown flag per dimension after the first (sample weights, which fit
    adds for its padding rows, are not compared)."""
    return tuple(
        (t.shape.rank, tuple(d is not None for d in t.shape[1:]))
        if t.shape.rank is not None else (None, ())
        for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor))


def _check_one_kind_of_trace(model, structure):
    """Refuses a private step traced with other non-batch dimensions known or unknown than
    the model's first traced private step (raised while tracing, before any step runs).

    ``dynamic_batch`` gives the batch dimension one kind of graph, and every dimension the
    model declares None (``declared_unknown_dims``) too; the others keep their static sizes,
    which the ghost rules use. Keras relaxes any dimension of ``train_on_batch``'s trace to
    None once it changes (a second sequence length), and the same batch then rounded
    differently in a graph with the time dimension known and one without: 2.85 C (LSTM,
    vectorized) and 3.65 C (a custom RNN cell under "auto") from one example, past crafted
    or ordinary examples (review of session 23's fix). Which kind of trace a step gets
    depends on the call shapes only, never on the data's values; but the call shapes follow
    the data where batches are padded to their longest sequence, and this refusal then
    told whether a longer sequence was in a batch (session 24 audit: 5 of 5 runs with it
    stopped, 0 of 5 without). A dimension the model declares None is therefore always
    hidden, and the refusal is left for dimensions a model declares static (or a
    subclassed model, which declares none) that a call leaves unknown."""
    if tf.executing_eagerly() or _internals.compiling_with_xla():
        return
    kind = _trace_kind(structure)
    first = getattr(model, "_dp_trace_kind", None)
    if first is None:
        object.__setattr__(model, "_dp_trace_kind", kind)
        return
    if kind != first:
        raise ValueError(
            "tf_dp: this model's private step was first traced with "
            f"{_kind_difference(first, kind)}. The same batch rounds differently in the two "
            "kinds of graph, which would let one example move the clipped sum by more than "
            "l2_norm_clip. Declare the dimensions that vary None in the model's keras.Input "
            "(a subclassed model: in model.build's shape, before the first step; tf_dp then leaves them unknown in every step), or give every batch one shape "
            "after the batch dimension and one rank (pad sequences to one length), and use "
            "a new model for another input shape.")


def _kind_difference(first, now):
    """Where two trace kinds differ, in words (the first differing tensor)."""
    if len(first) != len(now):
        return (f"{len(first)} input and target tensors, and is now traced with {len(now)}")
    for i, ((rank0, dims0), (rank1, dims1)) in enumerate(zip(first, now)):
        if rank0 != rank1:
            return (f"tensor {i} of (inputs, targets) of rank {rank0}, and is now traced with "
                    f"rank {rank1}")
        if dims0 != dims1:
            show = lambda dims: "(batch, " + ", ".join(  # noqa: E731
                "known" if d else "unknown" for d in dims) + ")"
            return (f"the non-batch dimensions of tensor {i} of (inputs, targets) "
                    f"{show(dims0)}, and is now traced with {show(dims1)}")
    return f"{first}, and is now traced with {now}"


def declared_unknown_dims(model, x, y, sample_weight=None):
    """Which dimensions ``dynamic_batch`` hides besides the batch: per dense tensor of
    ``(x, y, sample_weight)`` (flattened), a tuple of flags over its non-batch dimensions.

    A dimension of ``x`` the model's ``keras.Input`` declares None (for a subclassed model:
    the shape given to ``model.build``); every non-batch dimension of the targets but those
    the output of the same rank declares static (only the loss reads them, and it fails on
    a target that differs from the output there); every non-batch dimension of the sample
    weights: so every trace leaves them unknown, whatever
    sizes the calls have and whatever Keras relaxes. None for an input where the model
    declares nothing (a Sequential model without an Input, a model built by its first
    call) or the structures do not match. (Targets first took the output's
    declared None dimensions: targets of another rank, (B, T, 1) for an output (B, T), kept
    the refusal that followed padded-to-longest data, session 24 review.)"""
    flat_x, flat_y = tf.nest.flatten(x), tf.nest.flatten(y)
    flat_w = tf.nest.flatten(sample_weight)
    inputs = _declared(model, "_inputs_struct", "inputs", x)
    if inputs is None:
        _check_inputs_paired(model, x)
    outputs = _declared(model, "_outputs_struct", "outputs", y,
                        names=_output_names(model))
    out = []
    for k, t in enumerate(flat_x):
        out.append(_unknown_flags(t, None if inputs is None else inputs[k]))
    for k, t in enumerate(flat_y):
        declared_output = None if outputs is None else outputs[k]
        flags = _all_but_batch(t)
        if (flags and declared_output is not None and declared_output is not _UNREAD
                and len(tuple(declared_output.shape)) == t.shape.rank):
            # A dimension the output declares static and larger than 1 stays known where the
            # target has that size (a loss may read it: y_true.shape[-1], session 25
            # audit): a target of another size there fails the loss whatever tf_dp does.
            # Against a size of 1 losses broadcast (MSE of (B, K) targets and a (B, 1)
            # output runs): hidden (session 25 review).
            flags = tuple(not (d is not None and d > 1 and d == n)
                          for d, n in zip(tuple(declared_output.shape)[1:], t.shape[1:]))
        if flags and _sparse_label_axis(t, declared_output):
            flags = flags[:-1] + (False,)  # Keras' sparse losses squeeze it by its static 1
        out.append(flags)
    out.extend(_all_but_batch(t) for t in flat_w)
    return out


def _hidden_targets_note(x, y, hide):
    """What to add to an error raised while a step was traced: which target dimensions were
    unknown in the trace (``hide``), or None where none was. A loss that reads a target's
    static size fails then, with TensorFlow's words about unknown shapes only (session 26
    audit: targets packing [label, weight] as (B, 2) against a (B, 1) output, unstacked by
    the loss)."""
    n_x, n_y = len(tf.nest.flatten(x)), len(tf.nest.flatten(y))
    if not hide or len(hide) < n_x + n_y:
        return None
    flags = hide[n_x:n_x + n_y]
    hidden = [f"target {k}: dimension(s) {[i + 1 for i, h in enumerate(f) if h]}"
              for k, f in enumerate(flags) if f and any(f)]
    if not hidden:
        return None
    return ("tf_dp: if this error comes from the loss reading a target's static size "
            "(tf.unstack, y_true.shape[-1]): in this trace tf_dp kept target dimensions "
            f"unknown ({'; '.join(hidden)}). It keeps every non-batch target dimension "
            "unknown except where the model's output declares the same size, larger than 1, "
            "so that no refusal can follow the data (label lists padded to their batch's "
            "longest). Pass per-example weights as sample_weight rather than packed into the "
            "targets, or read the size with tf.shape(y_true).")


def _output_names(model):
    """Keras' names of a model's outputs (its output layers'), by which it pairs dict
    targets; None where it has none."""
    try:
        names = list(getattr(model, "output_names", None) or [])
    except (AttributeError, ValueError, TypeError):
        return None
    return names or None


def _all_but_batch(t):
    rank = t.shape.rank if isinstance(t, tf.Tensor) else None
    return None if not rank else (True,) * (rank - 1)


def _sparse_label_axis(t, declared_output):
    """Whether target ``t`` ends in the axis of 1 of sparse labels, (B, ..., 1) against an
    output of the same rank whose last dimension is declared larger (by the model's
    declaration and the target's rank, never its sizes elsewhere), or, without a declared
    output, a static last dimension of 1."""
    if t.shape.rank < 2 or t.shape[-1] != 1:
        return False
    if declared_output is None:
        return True
    shape = tuple(declared_output.shape)
    return len(shape) == t.shape.rank and shape[-1] is not None and shape[-1] > 1


def _declared(model, struct_name, list_name, given, names=None):
    """The model's declared KerasTensors aligned with ``tf.nest.flatten(given)`` (``_UNREAD``
    for a tensor the model does not read), or None. ``names``: by which names Keras pairs a
    dict with declared tensors (default: the tensors' own, as for inputs)."""
    try:
        declared = _declaration(model, struct_name, list_name)
        if declared is None:
            return None
        if any(isinstance(d, _BuiltShape) for d in tf.nest.flatten(declared)):
            flat = _paired_by_nesting(declared, given)
        else:
            flat = _paired_as_keras_does(declared, given, names)
    except (AttributeError, ValueError, TypeError):
        return None
    if flat is None or not all(d is _UNREAD or hasattr(d, "shape") for d in flat):
        return None
    return flat


def _declaration(model, struct_name, list_name):
    """The model's declared inputs or outputs (KerasTensors, or ``_BuiltShape`` for a
    subclassed model's build shapes) in their structure, or None."""
    declared = model.__dict__.get(struct_name)
    if declared is None:
        declared = getattr(model, list_name, None)
    if declared is None and struct_name == "_inputs_struct":
        declared = _built_input_shapes(model)
    return declared


def _check_inputs_paired(model, x):
    """Refuses inputs ``x`` that tf_dp cannot pair with a model's declared inputs when those
    declare a non-batch dimension None: that dimension would then be known in the trace,
    and the trace-kind refusal would follow the data (a longer sequence sampled stops
    training; session 26 audit). Depends on the structure of ``x`` and the declarations
    only, never on sizes or values. A model declaring every dimension statically needs
    nothing hidden, and is not refused."""
    try:
        declared = _declaration(model, "_inputs_struct", "inputs")
        leaves = tf.nest.flatten(declared) if declared is not None else []
    except (AttributeError, ValueError, TypeError):
        return
    unknown = [d for d in leaves
               if hasattr(d, "shape") and any(n is None for n in tuple(d.shape)[1:])]
    if not unknown:
        return
    given = tf.nest.map_structure(
        lambda t: f"shape={tuple(t.shape)}" if hasattr(t, "shape") else type(t).__name__, x)
    shown = tf.nest.map_structure(
        lambda d: f"{getattr(d, 'name', 'input')}: shape={tuple(d.shape)}"
        if hasattr(d, "shape") else repr(d), declared)
    raise ValueError(
        "tf_dp cannot pair the inputs given with the model's declared inputs (given: "
        f"{given}; declared: {shown}). The model declares dimensions None, which tf_dp "
        "keeps unknown in every trace so that no refusal can follow the data (a batch "
        "padded to a longer sequence); unpaired, they would be known. Pass the inputs in "
        "the structure the model declares (the same nesting, or a dict keyed by the "
        "Inputs' names); a subclassed model declares by model.build(shape): build it with "
        "shapes nested as the inputs it is fed (a dict of shapes for a dict).")


class _Unread:
    """A given tensor the model does not read (a dict key Keras drops): every non-batch
    dimension is hidden, so its shapes can never change a trace's kind."""

    def __repr__(self):
        return "_UNREAD"


_UNREAD = _Unread()


def _paired_as_keras_does(declared, given, names=None):
    """The declared tensors aligned with ``tf.nest.flatten(given)``, paired as Keras'
    functional models pair what they are given with their Inputs
    (``Functional._standardize_inputs``), and as its compiled loss pairs targets with the
    outputs: a dict given for declarations that are not a dict is first read by the
    declared tensors' names (``names``; targets: ``model.output_names``), its other keys
    unread (``_UNREAD``); then both sides are flattened (dict keys sorted, at every level)
    and paired in order. Given tensors beyond the declared ones are unread (Keras drops
    them). None when fewer are given than declared, names are missing, or a dict
    declaration's keys are not in sorted order while a non-dict is given (Keras refuses
    that). Every nesting and one-element list follows from these two steps: the layouts
    session 24's review and session 25's audits found (a dict by name for a list of Inputs,
    a list for a dict, a bare array for a one-input dict, nested dicts fed lists, lists
    nested in a dict's values) each hid nothing before, and the trace-kind refusal
    followed padded-to-longest data."""
    # Both sides flattened by Keras' own tree, as Keras flattens them (an OrderedDict in its
    # insertion order, where tf.nest sorts its keys: session 26 review); ``index`` holds each
    # given tensor's position in ``tf.nest.flatten(given)``, the order tf_dp's flags follow.
    flat_declared = keras.tree.flatten(declared)
    count = len(tf.nest.flatten(given))
    positions = iter(range(count))
    index = tf.nest.map_structure(lambda _: next(positions), given)
    if isinstance(index, dict) and not isinstance(declared, dict):
        if names is None:
            names = [getattr(d, "name", None) for d in flat_declared]
        if (len(names) != len(flat_declared) or None in names or len(set(names)) != len(names)
                or not set(names) <= set(index)):
            return None
        index = [index[name] for name in names]
    elif (isinstance(declared, dict) and not isinstance(index, dict)
          and list(declared) != sorted(declared)):
        return None
    flat_index = keras.tree.flatten(index)
    if len(flat_index) < len(flat_declared):
        return None
    # More given than declared: Keras pairs the first ones in order and drops the rest
    # (``Functional._convert_inputs_to_tensors`` zips), with a warning: a dict of inputs
    # with one more key than the Inputs, {"a", "b", "mask"}. Returning None here hid
    # nothing, and the trace-kind refusal followed padded-to-longest data again (session
    # 26 audit: T = 7 refused only when sampled).
    out = [_UNREAD] * count
    for i, d in zip(flat_index, flat_declared):
        out[i] = d
    return out


def _paired_by_nesting(declared, given):
    """A subclassed model's build shapes (``_BuiltShape`` leaves) aligned with
    ``tf.nest.flatten(given)``, by the nesting of both: a dict by its keys, a list or tuple
    by position, a one-element list for one shape; given tensors the build names nowhere
    are unread (``_UNREAD``, every dimension hidden). None where the build names a key or
    position that is not given, or the kinds differ.

    Keras does not pair a subclassed model's inputs: its ``call`` reads what it is given by
    key or position. Pairing them as a functional model's (sorted keys zipped in order)
    gave ``model.build({"seq": (None, None, 3)})`` fed ``{"seq", "attention_mask"}`` the
    mask for the sequence's declaration and left the sequence's length known, so the
    trace-kind refusal followed padded-to-longest data (session 26 review: refused only
    when a longer sequence was sampled)."""
    count = len(tf.nest.flatten(given))
    positions = iter(range(count))
    index = tf.nest.map_structure(lambda _: next(positions), given)
    out = [_UNREAD] * count

    def pair(d, g):
        if isinstance(d, _BuiltShape):
            if isinstance(g, (list, tuple)) and len(g) == 1:
                g = g[0]
            if not isinstance(g, int):
                return False
            out[g] = d
            return True
        if isinstance(d, dict):
            return isinstance(g, dict) and all(k in g and pair(v, g[k]) for k, v in d.items())
        if isinstance(d, (list, tuple)):
            return (isinstance(g, (list, tuple)) and len(g) >= len(d)
                    and all(pair(v, x) for v, x in zip(d, g)))
        return False

    return out if pair(declared, index) else None


class _BuiltShape:
    """A shape a model was built with, standing for a declared input (``.shape``)."""

    def __init__(self, shape):
        self.shape = tuple(None if d is None else int(d) for d in shape)


def _is_shape(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(
        d is None or (isinstance(d, numbers.Integral) and not isinstance(d, bool))
        for d in value)


def _built_input_shapes(model):
    """The input shapes a model declares by its ``build``, for models without
    ``keras.Input`` (a subclassed model): the one argument of ``model.build(shape)``
    (``(None, None, 8)`` declares the length None), a shape or a dict, list or tuple of
    shapes, as ``_BuiltShape`` leaves; None where the model was built otherwise (several
    build arguments, or none recorded). A model built by its first call records that
    call's sizes: nothing is declared None then, and the trace-kind refusal stays."""
    shapes = model.__dict__.get("_build_shapes_dict")
    if not isinstance(shapes, dict) or len(shapes) != 1:
        return None
    (value,) = shapes.values()

    def leaves(v):
        if isinstance(v, tf.TensorShape):
            v = v.as_list() if v.rank is not None else None
        if _is_shape(v):
            return _BuiltShape(v)
        if isinstance(v, dict):
            return {k: leaves(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)) and v:
            return type(v)(leaves(x) for x in v)
        raise TypeError("not a shape")

    out = leaves(value)
    if isinstance(out, (list, tuple)) and len(out) == 1:
        out = out[0]
    return out


def _unknown_flags(t, declared):
    """Flags over ``t``'s non-batch dimensions: declared None in ``declared`` (a KerasTensor
    of ``t``'s rank, or of one more or one less where Keras adjusts the rank as it feeds
    it), all of them for a tensor the model does not read (``_UNREAD``), or None."""
    if declared is None or not isinstance(t, tf.Tensor) or not t.shape.rank:
        return None
    if declared is _UNREAD:
        return _all_but_batch(t)
    shape = tuple(declared.shape)
    flags = tuple(d is None for d in shape[1:])
    if len(shape) == t.shape.rank:
        return flags
    # Keras' functional models squeeze a trailing axis of 1 the Input lacks, and add one
    # the Input declares (Functional._adjust_input_rank): (B, T) fed to Input((None, 1)),
    # (B, T, 1) to Input((None,)) (session 25 review).
    if t.shape.rank == len(shape) + 1 and t.shape[-1] == 1:
        return flags + (False,)
    if t.shape.rank == len(shape) - 1 and shape[-1] == 1:
        return flags[:-1]
    return None


def dynamic_batch(structure, hide=None):
    """``structure`` with the batch dimension of its dense tensors made unknown to the
    graph, in a traced step outside XLA (eagerly, or under XLA, unchanged); also, where
    ``hide`` (``declared_unknown_dims``: per flattened tensor, flags over its non-batch
    dimensions, or None) flags them, other dimensions.

    The same batch rounded differently in a graph traced with a static batch dimension than
    in one traced with a dynamic one (the LSTM ghost rule, Embedding -> LayerNormalization:
    kernels and code paths chosen from a known size). Keras traces ``train_on_batch``'s first
    batch size static and later ones dynamic, so two neighbouring batches could run in the
    two graphs: one example moved the clipped sum by 3.04 C past 30 crafted examples whose
    gradients are mostly rounding (session 23 audit;
    ``tests/privacy/static_batch_shape_test.py``). With the batch dimension always dynamic
    every private step runs the one kind of graph. (XLA compiles each shape on its own:
    ``XLA_BATCH_SHAPES``, and fit pads to one shape there.)

    Hidden from Grappler too: every batched tensor is sliced to its first ``tf.shape(t)[0] +
    zero`` rows (all of them, a view), with ``zero`` an integer 0 from a stateful op
    (``tf.timestamp() < 0``) that no graph optimisation folds, so no shape inference can
    recover the count. ``PlaceholderWithDefault`` hid the size from TensorFlow's shape
    inference but not from Grappler's (a reshape to ``[rows, ...]`` neither: its output's
    count follows from the input's), whose constant folding then still made a mean's
    gradient (GlobalAveragePooling1D after a LayerNormalization) divide by a constant where
    the dynamic graph divides by a computed count, rounding differently. Tensors traced
    with a dynamic batch take the same ops, so both kinds of trace hold one graph."""
    if tf.executing_eagerly() or _internals.compiling_with_xla():
        return structure
    batched = lambda t: isinstance(t, tf.Tensor) and bool(t.shape.rank)  # noqa: E731
    flat = tf.nest.flatten(structure)
    if not any(batched(t) for t in flat):
        return structure
    hide = list(hide) if hide is not None else [None] * len(flat)
    if len(hide) != len(flat):
        raise ValueError(f"dynamic_batch: {len(hide)} flags for {len(flat)} tensors.")
    with tf.name_scope(DYNAMIC_BATCH_SCOPE):
        zero = tf.cast(tf.timestamp() < 0.0, tf.int32)

        def dynamic(t, flags):
            if not batched(t):
                return t
            rank = t.shape.rank
            flags = tuple(flags) if flags is not None else (False,) * (rank - 1)
            dims = tf.shape(t, out_type=tf.int32)
            size = [dims[0] + zero] + [dims[i + 1] + zero if flag else -1
                                       for i, flag in enumerate(flags)]
            out = tf.slice(t, tf.constant([0] * rank, tf.int32), tf.stack(size))
            # the other dimensions as they were
            out.set_shape([None] + [None if flag else d
                                    for flag, d in zip(flags, t.shape[1:].as_list())])
            return out

        return tf.nest.pack_sequence_as(
            structure, [dynamic(t, f) for t, f in zip(flat, hide)])


#: the name scope of the ops that hide a static batch dimension (before the model: no norm)
DYNAMIC_BATCH_SCOPE = "tf_dp_dynamic_batch"


def _at_least_min_rows(x, y, sample_weight, n, min_rows=MIN_ROWS):
    """``(x, y, sample_weight)`` with rows of sample weight 0 appended up to
    ``padded_row_count(n, min_rows)`` rows (at least ``min_rows``, a multiple of
    ``ROW_MULTIPLE``): copies of the first row, or zeros for an empty batch.

    An example's gradient must not depend on how many other examples its batch holds, yet
    TensorFlow's kernels round a row differently for different batch sizes: on this CPU,
    without XLA, at 1 -> 2, 2 -> 3, 3 -> 4 and 9 -> 16 rows (convolutions, LayerNormalization,
    GroupNormalization, LSTM, GRU, Embedding; bit-identical from 16 rows to 300 in the
    session 20 sweep), and under XLA at thresholds that follow the matrix shapes (fit then
    pads its batches to one size). An example crafted so that its gradient is mostly
    rounding then moves when another example joins the batch, and the sum by more than C
    (docs/privacy.md, "An example's gradient must not depend on its batch's size"). Below
    ``min_rows`` the batch runs at ``min_rows`` rows; padding rows add nothing to the sums
    and the caller gets the outputs of the real rows only. This also gives XLA no batch of
    0 or 1 row, which several paths could not compile.

    A multiple of ``ROW_MULTIPLE`` rows (session 21 audit): Eigen's elementwise kernels run
    whole SIMD packets on the body of a tensor and a scalar path, which rounds
    transcendental functions differently (sigmoid, its gradient, softplus, log, exp), on a
    final partial packet. Which example's entries fall in that tail followed the batch size
    and the example's row, so an example joining the batch ahead of a crafted one moved the
    sum by 2.02 C (a shared Dense with a sigmoid). With every batch-major tensor a whole
    number of packets there is no tail.
    Without sample weights, the real rows get weight 1, which is what no weight means.
    """
    if isinstance(n, int) and n == padded_row_count(n, min_rows):
        return x, y, sample_weight
    if sample_weight is None:
        sample_weight = tf.ones([n], tf.float32)
    rows = padded_row_count(n, min_rows)

    def pad(t, weight=False):
        # Copies of the first row (zeros for an empty batch; weight 0 for the weights):
        # they bring no new value into the batch (no new Embedding id, whose JL directions
        # are drawn per distinct id).
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        if weight:
            return padded_rows(t, rows)
        zero_row = tf.zeros(tf.concat([[1], tf.shape(t)[1:]], 0), t.dtype)
        return padded_rows(t, rows, filler=tf.concat([t[:1], zero_row], axis=0)[:1])

    with tf.name_scope(PADDING_SCOPE):
        return (tf.nest.map_structure(pad, x), tf.nest.map_structure(pad, y),
                pad(sample_weight, weight=True))


#: the name scope of the ops that pad a small batch (before the model: no norm)
PADDING_SCOPE = "tf_dp_min_rows"


#: the gradient noise's sub-stream of the optimizer's step seed (randomness.fold_seed)
_GRADIENT_NOISE_STREAM = 0x4E4F4953  # "NOIS"


@tf.autograph.experimental.do_not_convert
def gaussian_noise(shapes_dtypes, stddev, seed, after=None):
    """Independent N(0, stddev^2) noise for each (shape, dtype), from a stateless seed.

    ``seed`` is a (2,) int64 tensor (a secret stream's draw, ``tf_dp.core.randomness``); each
    tensor gets its own derived seed with all 128 of its bits, so noise is independent
    across variables and no seed can be found by search without ``seed``.

    ``after``: optional tensors, one per entry (e.g. the clipped sums the noise is added to).
    Each draw then waits for its tensor. The noise does not depend on the data, so without
    this a graph executor may draw it first and keep every variable's noise alive through the
    whole backward pass (for a 32000-row embedding, 31 MiB held at the step's peak:
    docs/scaling.md section 3 (d)). The values are the same either way.
    """
    if after is not None and len(after) != len(shapes_dtypes):
        raise ValueError(f"`after` must have one tensor per noise tensor: got {len(after)} "
                         f"for {len(shapes_dtypes)}.")
    if not shapes_dtypes:
        return []
    # Variable i's draw is gaussian.normal(shape, seed=s_i) * stddev with s_i row i of
    # split_seed(fold_seed(seed, _GRADIENT_NOISE_STREAM), n): 128 secret bits each (not
    # stateless_fold_in(seed, i), whose seeds keep 32: randomness.fold_seed); above
    # gaussian.SEGMENT values, in segments. Not TensorFlow's normal op, whose draws never
    # exceed 5.68 (tf_dp.core.gaussian).
    seeds = tf.unstack(randomness.split_seed(
        randomness.fold_seed(seed, _GRADIENT_NOISE_STREAM), len(shapes_dtypes)),
        len(shapes_dtypes))
    alg = tf.constant(randomness.PHILOX, tf.int32)  # one for all draws
    stddev = tf.cast(stddev, tf.float64)
    out = [None] * len(shapes_dtypes)
    # Formed in float64 (the private step's sums are float64: ghost.SUM_DTYPE), so that sum
    # and noise are added before any rounding to the variables' dtype. One Box-Muller
    # transform per group of consecutive variables of at most gaussian.SEGMENT values (fewer
    # graph ops; its temporaries, ~40 bytes per value, stay bounded); a larger variable
    # alone, which gaussian.normal draws in segments.
    shapes = [shape if isinstance(shape, tf.Tensor) else tf.TensorShape(shape).as_list()
              for shape, _ in shapes_dtypes]
    waits = [None] * len(shapes) if after is None else list(after)
    for group in _noise_groups(shapes):
        if len(group) == 1:
            draws = [gaussian.normal(shapes[group[0]], seeds[group[0]], alg=alg,
                                     after=waits[group[0]])]
        else:
            draws = gaussian.normals([shapes[i] for i in group], [seeds[i] for i in group],
                                     alg=alg, after=[waits[i] for i in group])
        for i, z in zip(group, draws):
            out[i] = tf.cast(z * stddev, shapes_dtypes[i][1])
    return out


def _noise_groups(shapes):
    """Indices of ``shapes`` in groups of consecutive ones of at most ``gaussian.SEGMENT``
    values together (a shape not known statically forms a group of its own)."""
    return consecutive_groups([None if isinstance(shape, tf.Tensor)
                               else tf.TensorShape(shape).num_elements() for shape in shapes],
                              gaussian.SEGMENT)
