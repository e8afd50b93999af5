"""`ReparamConv2D`: a `keras.layers.Conv2D` whose kernel is trained through gradient carriers."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import activations, ops

from tf_dp import _internals
from tf_dp.core import ghost
from tf_dp.layers._reparam_layer import ReparamLayer, masked as _masked, reject_unsupported
from tf_dp.layers.lsg import unit_importances


def _pair(value, name):
    values = (value, value) if isinstance(value, int) else tuple(value)
    if len(values) != 2 or not all(isinstance(v, int) and v > 0 for v in values):
        raise ValueError(f"`{name}` must be a positive int or a pair of them, got {value!r}")
    return values


@keras.saving.register_keras_serializable(package="tf_dp")
class ReparamConv2D(ReparamLayer):
    """`Conv2D` with RGP gradient carriers (and optional LSG sparsity), for private training.

    Same outputs, arguments and trainable weights (``kernel`` ``[kh, kw, c_in, c_out]``,
    ``bias`` ``[c_out]``) as `keras.layers.Conv2D`. The kernel is seen as the matrix
    ``W ∈ R^{m×n}``, ``m = kh·kw·c_in``, ``n = c_out`` (a plain reshape), and reparametrized
    as in RGP §2.1 by two convolutions and a residual (``*`` is convolution)::

        y = (x * L_eff) * R_eff + x * stop_gradient(W − L·R) + b
          = x * sg(W) + (h * R_eff − sg(h * R_eff)) + b,   h = sg(x) * L_eff  (as computed:
            same value and gradients without the residual kernel W − L·R)
        L: [kh, kw, c_in, r]  conv with the layer's kernel size, strides, padding, dilation
        R: [1, 1, r, c_out]   1×1 conv
        ∂W ≈ ∂L·R + L·∂R − L·Lᵀ·∂L·R           (on the matrix view, RGP Corollary 2.1.1)

    ``L`` here plays RGP's ``R`` (the paper writes ``h = W·x``, Keras ``y = x·W``, so the
    roles transpose): in both, the carrier with the original kernel size sees the input first.

    LSG units are channels, importances kernel-level sums ``Σ_{h,w} |W[h, w, i, j]|`` summed
    over the other channel axis. Masks: ``left_mask`` ``[1, 1, c_in, 1]`` (all rows of ``L``
    belonging to a frozen input channel), ``right_mask`` ``[1, 1, 1, c_out]``.

    The pipeline protocol (``kernel``, ``bias``, ``carrier_variables()``, ``noise_masks()``,
    ``reconstruct_gradient()``, ``update_carriers()``, ``reset_reference_weights()``) and the
    non-trainable weights are those documented in `ReparamDense`; carrier shapes as above.

    Args:
        filters, kernel_size, strides, padding, data_format, dilation_rate, groups,
            activation, use_bias, kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer, activity_regularizer, kernel_constraint, bias_constraint: as in
            `keras.layers.Conv2D`. ``groups`` must be 1 (a grouped kernel is not one matrix);
            ``lora_rank``/``lora_alpha`` must be None.
        rank: number of carrier directions ``r``, ``1 ≤ r ≤ min(kh·kw·c_in, c_out)``.
        sparsity, power_iterations, warmup_steps, carrier_init, seed: as in `ReparamDense`.

    Reference: Yu, Zhang, Chen, Yin, Liu, "Large Scale Private Learning via Low-rank
    Reparametrization", ICML 2021, §2.1; Ito et al., "Scaling Private Deep Learning with
    Low-Rank and Sparse Gradients", arXiv:2207.02699.
    """

    def __init__(
        self,
        filters,
        kernel_size,
        strides=(1, 1),
        padding="valid",
        data_format=None,
        dilation_rate=(1, 1),
        groups=1,
        activation=None,
        use_bias=True,
        lora_rank=None,
        lora_alpha=None,
        *,
        rank,
        **kwargs,
    ):
        if not isinstance(filters, int) or isinstance(filters, bool) or filters <= 0:
            raise ValueError(f"`filters` must be a positive integer, got {filters!r}")
        if groups != 1:
            raise ValueError(
                f"`groups` must be 1 for ReparamConv2D (a grouped kernel is not one matrix), "
                f"got {groups!r}"
            )
        reject_unsupported("ReparamConv2D", lora_rank=lora_rank)
        kernel_size = _pair(kernel_size, "kernel_size")
        strides = _pair(strides, "strides")
        dilation_rate = _pair(dilation_rate, "dilation_rate")
        if max(strides) > 1 and max(dilation_rate) > 1:
            raise ValueError(
                f"`strides > 1` not supported in conjunction with `dilation_rate > 1`, got "
                f"strides={strides} and dilation_rate={dilation_rate}"
            )
        padding = padding.lower() if isinstance(padding, str) else padding
        if padding not in ("valid", "same"):
            raise ValueError(f"`padding` must be 'valid' or 'same', got {padding!r}")
        data_format = data_format or keras.config.image_data_format()
        if data_format not in ("channels_last", "channels_first"):
            raise ValueError(
                f"`data_format` must be 'channels_last' or 'channels_first', got {data_format!r}"
            )
        super().__init__(rank=rank, **kwargs)
        self.filters = filters
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.data_format = data_format
        self.dilation_rate = dilation_rate
        self.groups = 1
        self.activation = activations.get(activation)
        self.use_bias = use_bias
        self.input_spec = keras.layers.InputSpec(min_ndim=4)

    def _channel_axis(self):
        return -1 if self.data_format == "channels_last" else 1

    def build(self, input_shape):
        input_channel = input_shape[self._channel_axis()]
        self.compute_output_shape(input_shape)  # validates the spatial sizes, as Keras does
        kernel_shape = self.kernel_size + (input_channel, self.filters)
        self._add_kernel_and_bias(kernel_shape, (self.filters,) if self.use_bias else None)
        self._set_matrix_view(
            kernel_shape=kernel_shape,
            input_units_shape=kernel_shape[:3],
            output_units_shape=(self.filters,),
            left_shape=self.kernel_size + (input_channel, self.rank),
            right_shape=(1, 1, self.rank, self.filters),
            left_mask_shape=(1, 1, input_channel, 1),
            right_mask_shape=(1, 1, 1, self.filters),
        )
        self._build_carriers()
        self.input_spec = keras.layers.InputSpec(
            min_ndim=4, axes={self._channel_axis(): input_channel}
        )
        self.built = True

    def _unit_importances(self, kernel):
        # LSG kernel-level importances: each [kh, kw] slice counts by its L1 norm.
        return unit_importances(tf.reduce_sum(tf.abs(kernel), axis=(0, 1)))

    def _convolve(self, inputs, kernel):
        return ops.conv(
            inputs,
            kernel,
            strides=list(self.strides),
            padding=self.padding,
            dilation_rate=self.dilation_rate,
            data_format=self.data_format,
        )

    def call(self, inputs):
        left, right = self._forward_carriers()
        hidden = self._convolve(ops.stop_gradient(inputs), left)
        low_rank = ops.conv(hidden, right, strides=1, padding="valid", data_format=self.data_format)
        outputs = self._convolve(inputs, self._frozen_kernel())
        outputs = ops.add(outputs, self._carrier_term(low_rank))
        if self.use_bias:
            if self.data_format == "channels_last":
                bias_shape = (1, 1, 1, self.filters)
            else:
                bias_shape = (1, self.filters, 1, 1)
            outputs = ops.add(outputs, ops.reshape(self.bias, bias_shape))
        if self.activation is not None:
            return self.activation(outputs)
        return outputs

    def ghost_call(self, ctx, inputs):
        """Ghost rule (``tf_dp.register_ghost_rule`` protocol): as ``call``; L is a
        convolution of the original size (im2col patches of ``x``, masked input channels),
        R a 1x1 convolution of the hidden map (masked output channels)."""
        if type(self).call is not ReparamConv2D.call:
            return NotImplemented
        x = ctx.batch_input(self, inputs)
        left, right, m_in, m_out = self._ghost_carriers(ctx, x)
        channels_last = self.data_format == "channels_last"
        hidden = self._convolve(tf.stop_gradient(x), left)
        low_rank = tf.nn.conv2d(hidden, right, strides=1, padding="VALID",
                                data_format="NHWC" if channels_last else "NCHW")
        z = self._convolve(x, ctx.read(self.kernel, x.dtype)) + self._carrier_term(low_rank)
        if self.use_bias:
            shape = (1, 1, 1, self.filters) if channels_last else (1, self.filters, 1, 1)
            z = z + tf.reshape(ctx.read(self.bias, x.dtype), shape)

        def to_last(t):
            return t if channels_last else tf.transpose(t, [0, 2, 3, 1])

        def left_a():
            xl = to_last(x)
            if m_in is not None:
                xl = xl * tf.cast(m_in, xl.dtype)
            return ghost.conv_patches(xl, self.kernel_size, self.strides, self.dilation_rate,
                                      self.padding)

        ctx.outer(self.left_carrier, hidden, left_a, lambda dz: ghost.rows(to_last(dz)))
        ctx.outer(self.right_carrier, z, lambda: ghost.rows(to_last(hidden)),
                  lambda dz: _masked(ghost.rows(to_last(dz)), m_out))
        if self.use_bias:
            ctx.direct(self.bias, z, lambda dz: tf.reduce_sum(ghost.rows(to_last(dz)), 1))
        return self.activation(z) if self.activation is not None else z

    def compute_output_shape(self, input_shape):
        return _internals.conv_output_shape(
            input_shape,
            self.filters,
            self.kernel_size,
            strides=self.strides,
            padding=self.padding,
            data_format=self.data_format,
            dilation_rate=self.dilation_rate,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "filters": self.filters,
                "kernel_size": self.kernel_size,
                "strides": self.strides,
                "padding": self.padding,
                "data_format": self.data_format,
                "dilation_rate": self.dilation_rate,
                "groups": self.groups,
                "activation": activations.serialize(self.activation),
                "use_bias": self.use_bias,
            }
        )
        config.update(self._weight_options_config())
        return config
