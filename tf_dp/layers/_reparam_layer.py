"""Shared machinery of the reparametrized layers (private; the public classes subclass it).

A subclass builds its own `kernel` and `bias` exactly as the Keras layer it replaces, sets the
matrix view of the kernel (``_matrix_shape``, carrier and mask shapes, and the kernel <->
matrix maps when the kernel is not a plain reshape of an ``[m, n]`` matrix), then calls
`_build_carriers()`. Everything the private-step pipeline calls lives here: see the protocol
in `ReparamDense`'s docstring.
"""

from __future__ import annotations

import contextlib
import math
import random

import keras
import tensorflow as tf
from keras import constraints, initializers, ops, regularizers

from tf_dp import _validation
from tf_dp.layers.carriers import power_method, random_carriers, reconstruct_update
from tf_dp.layers.lsg import lsg_masks, unit_importances

CARRIER_INITS = ("historical", "random")


def validate_reparam_args(rank, sparsity, power_iterations, warmup_steps, carrier_init, seed):
    """Raises ValueError naming the first bad RGP/LSG constructor argument."""
    _validation.positive_int(rank, "rank")
    if sparsity is not None:
        _validation.fraction(sparsity, "sparsity")
    _validation.positive_int(power_iterations, "power_iterations")
    _validation.non_negative_int(warmup_steps, "warmup_steps")
    _validation.one_of(carrier_init, "carrier_init", CARRIER_INITS)
    _validation.seed(seed)


def masked(factor, mask):
    """``factor`` (B, T, d) with its last axis multiplied by a 0/1 ``mask`` (d,) (LSG)."""
    return factor if mask is None else factor * tf.cast(mask, factor.dtype)


def reject_unsupported(layer_name, **options):
    """Keras options the reparametrization cannot honour (LoRA, quantization)."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(
                f"`{name}` is not supported by {layer_name}: the kernel is already "
                f"reparametrized by gradient carriers, got {name}={value!r}"
            )


@contextlib.contextmanager
def kernel_gradients(layers):
    """Within the block, each reparametrized layer's ``kernel`` gets its full autodiff gradient.

    For analysis tools (`tf_dp.analysis.GradientGeometry`) that need ``∂loss/∂W`` of an
    RGP/LSG layer's effective weight (whose value is ``W``), a raw, non-private statistic.
    Only eager calls are allowed in the block: a `tf.function` traced there would keep the
    gradient path, so entering the block inside a trace is refused. The forward values and
    the carriers' gradients are unchanged.
    """
    if not tf.executing_eagerly():
        raise RuntimeError("kernel_gradients() is for eager analysis code only; it cannot be "
                           "entered while a tf.function is being traced.")
    layers = [layer for layer in layers if isinstance(layer, ReparamLayer)]
    for layer in layers:
        layer._analysis_kernel_gradient = True
    try:
        yield
    finally:
        for layer in layers:
            layer._analysis_kernel_gradient = False


class ReparamLayer(keras.layers.Layer):
    """Base of `ReparamDense`, `ReparamConv2D` and `ReparamEinsumDense`.

    Not registered for serialization and not meant to be instantiated: use a subclass.
    """

    def __init__(
        self,
        *,
        rank,
        sparsity=None,
        power_iterations=1,
        warmup_steps=0,
        carrier_init="historical",
        seed=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        **kwargs,
    ):
        validate_reparam_args(rank, sparsity, power_iterations, warmup_steps, carrier_init, seed)
        super().__init__(**kwargs)
        # The Keras kernel/bias options, as the plain layer takes them.
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.rank = int(rank)
        self.sparsity = None if sparsity is None else float(sparsity)
        self.power_iterations = int(power_iterations)
        self.warmup_steps = int(warmup_steps)
        self.carrier_init = carrier_init
        # Resolved now so that the config (and hence a reloaded model) reproduces the carriers;
        # `random` is seeded by `keras.utils.set_random_seed`.
        self.seed = int(seed) if seed is not None else random.randint(0, 2**31 - 1)

    # ------------------------------------------------------------------ kernel and bias
    def _weight_options_config(self):
        return {
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
        }

    def _add_kernel_and_bias(self, kernel_shape, bias_shape, kernel_initializer=None):
        """Creates ``kernel`` and ``bias`` (None when ``bias_shape`` is None) as Keras does."""
        self.kernel = self.add_weight(
            name="kernel",
            shape=tuple(kernel_shape),
            initializer=kernel_initializer or self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            dtype=self.dtype,
            trainable=True,
        )
        self.bias = None
        if bias_shape is not None:
            self.bias = self.add_weight(
                name="bias",
                shape=tuple(bias_shape),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
                dtype=self.dtype,
                trainable=True,
            )

    # ------------------------------------------------------------------ build helpers
    def _set_matrix_view(
        self,
        kernel_shape,
        input_units_shape,
        output_units_shape,
        left_shape,
        right_shape,
        left_mask_shape,
        right_mask_shape,
    ):
        """Records how the kernel is seen as ``W ∈ R^{m×n}`` and checks `rank` against it."""
        self._kernel_shape = tuple(int(d) for d in kernel_shape)
        self._left_shape = tuple(int(d) for d in left_shape)
        self._right_shape = tuple(int(d) for d in right_shape)
        self._left_mask_shape = tuple(int(d) for d in left_mask_shape)
        self._right_mask_shape = tuple(int(d) for d in right_mask_shape)
        m = math.prod(int(d) for d in input_units_shape)
        n = math.prod(int(d) for d in output_units_shape)
        self._matrix_shape = (m, n)
        if self.rank > min(m, n):
            raise ValueError(
                f"`rank` must be <= min(m, n) = {min(m, n)} for layer '{self.name}' whose "
                f"kernel {self._kernel_shape} is a {m}x{n} matrix, got {self.rank}"
            )

    def _build_carriers(self):
        """Creates W0, the carriers, the LSG masks and the step counter (all non-trainable)."""

        def state(name, shape, initializer="zeros", dtype=None):
            # Every replica computes the same values (same W, same seed and step), so under a
            # tf.distribute strategy the first replica's assignment is the one to keep.
            return self.add_weight(
                name=name,
                shape=shape,
                initializer=initializer,
                dtype=dtype,
                trainable=False,
                aggregation="only_first_replica",
            )

        self.reference_kernel = state("reference_kernel", self._kernel_shape)
        self.left_carrier = state("left_carrier", self._left_shape)
        self.right_carrier = state("right_carrier", self._right_shape)
        self.left_mask = state("left_mask", self._left_mask_shape, "ones")
        self.right_mask = state("right_mask", self._right_mask_shape, "ones")
        self.carrier_step = state("carrier_step", (), dtype="int64")
        # Valid (orthonormal) carriers from the first call on, even when build runs while a
        # tf.function is being traced.
        with tf.init_scope():
            self.reset_reference_weights()

    # ------------------------------------------------------------------ matrix views
    def _kernel_as_matrix(self, kernel):
        return tf.reshape(kernel, self._matrix_shape)

    def _matrix_as_kernel(self, matrix):
        return tf.reshape(matrix, self._kernel_shape)

    def _left_as_matrix(self, left):
        return tf.reshape(left, (self._matrix_shape[0], self.rank))

    def _right_as_matrix(self, right):
        return tf.reshape(right, (self.rank, self._matrix_shape[1]))

    def _unit_importances(self, kernel):
        return unit_importances(self._kernel_as_matrix(kernel))

    # ------------------------------------------------------------------ forward helpers
    def _forward_carriers(self):
        """``(L_eff, R_eff)``: the carriers' values, gradients masked to the kept units (LSG)."""
        left = tf.convert_to_tensor(self.left_carrier)
        right = tf.convert_to_tensor(self.right_carrier)
        if self.sparsity:
            left_mask = ops.cast(self.left_mask, left.dtype)
            right_mask = ops.cast(self.right_mask, right.dtype)
            left = left * left_mask + ops.stop_gradient(left * (1.0 - left_mask))
            right = right * right_mask + ops.stop_gradient(right * (1.0 - right_mask))
        return left, right

    def _bias_and_activation(self, outputs):
        """``activation(outputs + bias)`` for a bias that broadcasts over ``outputs``."""
        if self.bias is not None:
            outputs = ops.add(outputs, ops.cast(self.bias, outputs.dtype))
        return self.activation(outputs) if self.activation is not None else outputs

    def _frozen_kernel(self):
        """``stop_gradient(W)`` in the kernel layout: W gets no autodiff gradient.

        Inside `kernel_gradients` (analysis only, eager) W itself: its autodiff gradient is
        then ``∂loss/∂W`` of the effective weight, which training never computes.
        """
        kernel = tf.convert_to_tensor(self.kernel)
        if getattr(self, "_analysis_kernel_gradient", False):
            return kernel
        return ops.stop_gradient(kernel)

    @staticmethod
    def _carrier_term(low_rank_output):
        """``y − stop_gradient(y)``: exactly zero, with ``y``'s gradient.

        The forward pass is ``x·sg(W) + carrier_term((sg(x)·L_eff)·R_eff)``: the value is the
        plain layer's ``x·W``, the carriers get the gradients of ``(x·L)·R`` (RGP Theorem 2.1)
        and ``x`` gets ``∂z·Wᵀ`` through the first term only (hence ``sg(x)`` in the carrier
        path). Same value and gradients as ``(x·L)·R + x·sg(W − L·R)`` without building the
        m×n residual ``W − L·R`` every call.
        """
        return low_rank_output - ops.stop_gradient(low_rank_output)

    # ------------------------------------------------------------------ ghost rule helpers
    def _ghost_carriers(self, ctx, x):
        """(L, R, left mask or None, right mask or None) for this layer's ghost rule.

        The rule reads the carriers' values through ``ctx`` (no autodiff through them: their
        per-example gradients come from the recorded factors, masked to the kept units
        exactly as the masked carriers' autodiff gradients are).
        """
        left, right = (ctx.read(c, x.dtype) for c in self.carrier_variables())
        if not self.sparsity:
            return left, right, None, None
        return left, right, tf.reshape(self.left_mask, [-1]), tf.reshape(self.right_mask, [-1])

    # ------------------------------------------------------------------ pipeline protocol
    def _require_built(self, method):
        if not self.built:
            raise ValueError(
                f"Layer '{self.name}' must be built (called once, or part of a built model) "
                f"before `{method}()`: its carriers are created at build"
            )

    def carrier_variables(self):
        """``[left_carrier, right_carrier]``: non-trainable Keras variables.

        The forward pass is differentiable w.r.t. them. `tf.GradientTape.watch` takes the
        backing `tf.Variable`s: ``tape.watch([v.value for v in layer.carrier_variables()])``;
        ``tape.gradient(loss, layer.carrier_variables())`` then returns ``[∂L, ∂R]``.
        """
        self._require_built("carrier_variables")
        return [self.left_carrier, self.right_carrier]

    def noise_masks(self):
        """``[left_mask, right_mask]`` broadcastable to the carriers; all ones without LSG."""
        self._require_built("noise_masks")
        return [tf.convert_to_tensor(self.left_mask), tf.convert_to_tensor(self.right_mask)]

    def reconstruct_gradient(self, grad_left, grad_right):
        """The gradient for `kernel` (kernel's shape) from carrier gradients (RGP Cor. 2.1.1).

        ``∂W = ∂L·R + L·∂R − L·Lᵀ·∂L·R`` on the matrix view, mapped back to the kernel layout.
        Uses the current carriers: call it before the next `update_carriers()`.
        """
        self._require_built("reconstruct_gradient")
        left = self._left_as_matrix(tf.convert_to_tensor(self.left_carrier))
        right = self._right_as_matrix(tf.convert_to_tensor(self.right_carrier))
        grad_left = tf.cast(self._left_as_matrix(grad_left), left.dtype)
        grad_right = tf.cast(self._right_as_matrix(grad_right), right.dtype)
        update = reconstruct_update(grad_left, grad_right, left, right)
        return tf.cast(self._matrix_as_kernel(update), self.kernel.dtype)

    def update_carriers(self):
        """New carriers and LSG masks for the coming step; tf.function-safe.

        Carriers come from the power method on the historical update ``ΔW = W − W0`` (RGP
        Algorithm 2), or on ``W`` itself while ``carrier_step < warmup_steps`` or while
        ``ΔW`` is exactly zero (no history yet); with ``carrier_init="random"`` they are
        Gaussian, orthonormalised. The Gaussian draws are seeded by ``(seed, carrier_step)``.
        LSG masks are recomputed from the current W. Then ``carrier_step`` is incremented.
        """
        self._require_built("update_carriers")
        step = tf.convert_to_tensor(self.carrier_step)
        weights = self._kernel_as_matrix(tf.convert_to_tensor(self.kernel))
        history = weights - self._kernel_as_matrix(tf.convert_to_tensor(self.reference_kernel))
        use_weights = tf.logical_or(step < self.warmup_steps, tf.reduce_all(tf.equal(history, 0.0)))
        self._assign_carriers(tf.where(use_weights, weights, history), step)
        self.carrier_step.assign_add(1)

    def reset_reference_weights(self):
        """``W0 ← W``, ``carrier_step ← 0``, carriers and masks recomputed from ``W``.

        Call after assigning weights from outside (`reparametrize` and `set_weights` with a
        plain layer's ``[kernel(, bias)]`` do it for you). A full reparam checkpoint restores
        W0, the carriers and the step instead, so history continues.
        """
        self.reference_kernel.assign(self.kernel)
        self.carrier_step.assign(0)
        self._assign_carriers(
            self._kernel_as_matrix(tf.convert_to_tensor(self.kernel)), tf.constant(0, tf.int64)
        )

    def _assign_carriers(self, source, step):
        seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
        source = tf.cast(source, self.left_carrier.dtype)
        if self.carrier_init == "random":
            m, n = self._matrix_shape
            left, right = random_carriers(m, n, self.rank, seed=seed, dtype=source.dtype)
        else:
            left, right = power_method(source, self.rank, self.power_iterations, seed=seed)
        self.left_carrier.assign(tf.reshape(left, self._left_shape))
        self.right_carrier.assign(tf.reshape(right, self._right_shape))
        input_mask, output_mask = lsg_masks(
            self._unit_importances(tf.convert_to_tensor(self.kernel)), self.sparsity
        )
        self.left_mask.assign(tf.reshape(input_mask, self._left_mask_shape))
        self.right_mask.assign(tf.reshape(output_mask, self._right_mask_shape))

    # ------------------------------------------------------------------ weight transfer
    def _plain_variables(self):
        return [self.kernel] + ([self.bias] if self.bias is not None else [])

    def set_weights(self, weights):
        """Full weight list, or the plain Keras layer's ``[kernel(, bias)]`` (then resets W0)."""
        if not self.built or len(weights) != len(self._plain_variables()):
            return super().set_weights(weights)
        for variable, value in zip(self._plain_variables(), weights):
            if tuple(variable.shape) != tuple(value.shape):
                raise ValueError(
                    f"Layer {self.name} weight shape {variable.shape} is not compatible with "
                    f"provided weight shape {value.shape}."
                )
            variable.assign(value)
        self.reset_reference_weights()

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "rank": self.rank,
                "sparsity": self.sparsity,
                "power_iterations": self.power_iterations,
                "warmup_steps": self.warmup_steps,
                "carrier_init": self.carrier_init,
                "seed": self.seed,
            }
        )
        return config
