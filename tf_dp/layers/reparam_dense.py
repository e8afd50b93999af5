"""`ReparamDense`: a `keras.layers.Dense` whose kernel is trained through gradient carriers."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import activations, ops

from tf_dp.core import ghost
from tf_dp.layers._reparam_layer import ReparamLayer, masked as _masked, reject_unsupported


@keras.saving.register_keras_serializable(package="tf_dp")
class ReparamDense(ReparamLayer):
    """`Dense` with RGP gradient carriers (and optional LSG sparsity), for private training.

    Same outputs, arguments and trainable weights (``kernel`` ``[m, n]``, ``bias`` ``[n]``) as
    `keras.layers.Dense`; the kernel ``W`` is reparametrized as (RGP eq. 2, ``y = x·W``)::

        W = L·R + stop_gradient(W − L·R)        L ∈ R^{m×r}, R ∈ R^{r×n} orthonormal
        y = (x·L_eff)·R_eff + x·stop_gradient(W − L·R) + b
          = x·sg(W) + (h·R_eff − sg(h·R_eff)) + b,   h = sg(x)·L_eff  (as computed: same
            value and gradients, no m×n residual; x's gradient flows through x·sg(W))
        ∂L = ∂W·Rᵀ,  ∂R = Lᵀ·∂W                (RGP Theorem 2.1)
        ∂W ≈ ∂L·R + L·∂R − L·Lᵀ·∂L·R           (RGP Corollary 2.1.1)

    so per-example gradients (and the noise) live in ``r·(m + n)`` dimensions instead of
    ``m·n``. With LSG ``sparsity = p``, only the ``⌈(1 − p)·units⌉`` most important input units
    (rows of L) and output units (columns of R) get gradients:
    ``L_eff = L·M_in + stop_gradient(L·(1 − M_in))`` and likewise for R.

    Protocol used by the tf_dp private-step pipeline (identical on every reparam layer):

    - ``kernel`` (trainable, Keras shape) gets NO autodiff gradient from the forward pass;
      ``bias`` (trainable) does. A ``kernel_regularizer`` still gives ``kernel`` its own
      (data-independent) autodiff gradient.
    - ``carrier_variables()`` → ``[left_carrier [m, r], right_carrier [r, n]]``,
      non-trainable; the forward pass is differentiable w.r.t. them (``tape.watch``).
    - ``noise_masks()`` → ``[left_mask [m, 1], right_mask [1, n]]``: 0/1, broadcastable to
      the carriers; rows of ``∂L`` for frozen input units and columns of ``∂R`` for frozen
      output units are zero. All ones when ``sparsity`` is None or 0.
    - ``reconstruct_gradient(grad_left, grad_right)`` → gradient for ``kernel`` ``[m, n]``.
    - ``update_carriers()``: once per logical step before the forward pass; tf.function-safe.
      Power method on ``ΔW = W − W0`` (on ``W`` during warm-up or while ``ΔW = 0``), then
      LSG masks from ``|W|``; increments ``carrier_step``.
    - ``reset_reference_weights()``: ``W0 ← W``, step 0, carriers from ``W``.

    Non-trainable weights, saved with the model: ``reference_kernel`` (W0), ``left_carrier``,
    ``right_carrier``, ``left_mask``, ``right_mask``, ``carrier_step``. `set_weights` also
    accepts the plain `Dense` layer's ``[kernel, bias]`` (and then resets W0 and carriers).

    Args:
        units, activation, use_bias, kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer, activity_regularizer, kernel_constraint, bias_constraint: as in
            `keras.layers.Dense`. ``lora_rank``/``lora_alpha``/``quantization_config`` are
            accepted for signature compatibility and must be None.
        rank: number of carrier directions ``r``, ``1 ≤ r ≤ min(m, n)`` (checked at build).
        sparsity: LSG fraction ``p ∈ [0, 1)`` of input and of output units to freeze; None
            (default) for plain RGP.
        power_iterations: power-method iterations ``K ≥ 1`` per carrier update (RGP: 1).
        warmup_steps: number of `update_carriers` calls that decompose ``W`` itself instead
            of the historical update.
        carrier_init: ``"historical"`` (RGP) or ``"random"`` (Gaussian carriers, ablation).
        seed: int seeding the Gaussian draws (stateless, with the step); None draws one.

    Reference: Yu, Zhang, Chen, Yin, Liu, "Large Scale Private Learning via Low-rank
    Reparametrization", ICML 2021; Ito, Liew, Takahashi, Sasaki, Onizuka, "Scaling Private
    Deep Learning with Low-Rank and Sparse Gradients", arXiv:2207.02699.
    """

    def __init__(
        self,
        units,
        activation=None,
        use_bias=True,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        *,
        rank,
        **kwargs,
    ):
        if not isinstance(units, int) or isinstance(units, bool) or units <= 0:
            raise ValueError(f"`units` must be a positive integer, got {units!r}")
        reject_unsupported(
            "ReparamDense", lora_rank=lora_rank, quantization_config=quantization_config
        )
        super().__init__(rank=rank, **kwargs)
        self.units = units
        self.activation = activations.get(activation)
        self.use_bias = use_bias
        self.input_spec = keras.layers.InputSpec(min_ndim=2)
        self.supports_masking = True

    def build(self, input_shape):
        input_dim = input_shape[-1]
        self._add_kernel_and_bias((input_dim, self.units), (self.units,) if self.use_bias else None)
        self._set_matrix_view(
            kernel_shape=(input_dim, self.units),
            input_units_shape=(input_dim,),
            output_units_shape=(self.units,),
            left_shape=(input_dim, self.rank),
            right_shape=(self.rank, self.units),
            left_mask_shape=(input_dim, 1),
            right_mask_shape=(1, self.units),
        )
        self._build_carriers()
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: input_dim})
        self.built = True

    def call(self, inputs, training=None):
        left, right = self._forward_carriers()
        hidden = ops.matmul(ops.stop_gradient(inputs), left)
        x = ops.matmul(inputs, self._frozen_kernel())
        x = ops.add(x, self._carrier_term(ops.matmul(hidden, right)))
        return self._bias_and_activation(x)

    def ghost_call(self, ctx, inputs, training=None):
        """Ghost rule (``tf_dp.register_ghost_rule`` protocol): ``h = sg(x) L`` and
        ``z = x sg(W) + (h R - sg(h R)) + b`` as in ``call``; L's per-example gradient is
        ``sum_t x_t (outer) dh_t``, R's ``sum_t h_t (outer) dz_t`` (RGP Theorem 2.1), with
        LSG's frozen rows / columns zeroed in the factors."""
        if type(self).call is not ReparamDense.call:
            return NotImplemented
        x = ctx.batch_input(self, inputs)
        left, right, m_in, m_out = self._ghost_carriers(ctx, x)
        last = [[x.shape.rank - 1], [0]]
        h = tf.tensordot(tf.stop_gradient(x), left, axes=last)
        low_rank = tf.tensordot(h, right, axes=[[h.shape.rank - 1], [0]])
        z = tf.tensordot(x, ctx.read(self.kernel, x.dtype), axes=last)
        z = z + self._carrier_term(low_rank)
        if self.bias is not None:
            z = z + ctx.read(self.bias, x.dtype)
        d, r = x.shape[-1], self.rank
        ctx.outer(self.left_carrier, h, lambda: _masked(ghost.rows(x, d), m_in))
        ctx.outer(self.right_carrier, z, lambda: ghost.rows(h, r),
                  lambda dz: _masked(ghost.rows(dz), m_out))
        if self.bias is not None:
            ctx.direct(self.bias, z, lambda dz: tf.reduce_sum(ghost.rows(dz), axis=1))
        return self.activation(z) if self.activation is not None else z

    def compute_output_shape(self, input_shape):
        output_shape = list(input_shape)
        output_shape[-1] = self.units
        return tuple(output_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "activation": activations.serialize(self.activation),
                "use_bias": self.use_bias,
            }
        )
        config.update(self._weight_options_config())
        return config
