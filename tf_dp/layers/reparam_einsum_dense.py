"""`ReparamEinsumDense`: a `keras.layers.EinsumDense` trained through gradient carriers."""

from __future__ import annotations

import re
import string

import keras
import tensorflow as tf
from keras import activations, initializers, ops

from tf_dp import _internals
from tf_dp.core.ghost.rules.einsum import bias_grad_fn, einsum_term, parse_einsum
from tf_dp.layers._reparam_layer import ReparamLayer, reject_unsupported



def split_einsum_kernel_axes(equation: str) -> tuple[str, str, str, str, str]:
    """``(input_spec, kernel_spec, output_spec, input_axes, output_axes)`` of an equation.

    ``input_axes`` are the kernel letters contracted with the input (not in the output),
    ``output_axes`` the kernel letters that appear in the output (not in the input), both in
    kernel order. Raises ValueError when the kernel is not a single matrix, i.e. a kernel axis
    is in both input and output (a batch of matrices) or in neither.
    """
    match = re.fullmatch(r"\s*([a-zA-Z.]+)\s*,\s*([a-zA-Z]+)\s*->\s*([a-zA-Z.]+)\s*", equation)
    if match is None:
        raise ValueError(
            f"`equation` must look like 'ab,bc->ac' (with optional '...' on the input and "
            f"output), got {equation!r}"
        )
    input_spec, kernel_spec, output_spec = match.groups()
    shared = [a for a in kernel_spec if a in input_spec and a in output_spec]
    unused = [a for a in kernel_spec if a not in input_spec and a not in output_spec]
    if shared or unused:
        raise ValueError(
            f"`equation` must contract every kernel axis with the input or carry it to the "
            f"output, not both, so that the kernel is one matrix; got {equation!r} "
            f"(kernel axes in both: {shared}, in neither: {unused})"
        )
    input_axes = "".join(a for a in kernel_spec if a in input_spec)
    output_axes = "".join(a for a in kernel_spec if a in output_spec)
    return input_spec, kernel_spec, output_spec, input_axes, output_axes


@keras.saving.register_keras_serializable(package="tf_dp")
class ReparamEinsumDense(ReparamLayer):
    """`EinsumDense` with RGP gradient carriers (and optional LSG), e.g. attention projections.

    Same outputs, arguments and trainable weights (``kernel``, ``bias`` with the Keras shapes)
    as `keras.layers.EinsumDense`. The kernel is seen as ``W ∈ R^{m×n}`` by grouping its axes
    contracted with the input (``m`` = product of their sizes) against its output axes
    (``n``), each group in kernel order; e.g. ``"abc,cde->abde"`` (query projection, ``c`` =
    model dim, ``d`` = heads, ``e`` = head dim) gives ``m = c``, ``n = d·e``. Then::

        y = einsum((x ⊗ L_eff) ⊗ R_eff) + einsum(equation, x, stop_gradient(W − L·R)) + b
          (computed as einsum(equation, x, sg(W)) + (u − sg(u)), u = einsum((sg(x) ⊗ L_eff)
          ⊗ R_eff): same value and gradients without the m×n residual W − L·R)
        L: [*input_axes, r]    R: [r, *output_axes]
        ∂W ≈ ∂L·R + L·∂R − L·Lᵀ·∂L·R           (on the matrix view, RGP Corollary 2.1.1)

    LSG units are the entries of the grouped input and output axes; masks ``left_mask``
    ``[*input_axes, 1]``, ``right_mask`` ``[1, *output_axes]``.

    The pipeline protocol (``kernel``, ``bias``, ``carrier_variables()``, ``noise_masks()``,
    ``reconstruct_gradient()``, ``update_carriers()``, ``reset_reference_weights()``) and the
    non-trainable weights are those documented in `ReparamDense`; carrier shapes as above.

    Args:
        equation, output_shape, activation, bias_axes, kernel_initializer, bias_initializer,
            kernel_regularizer, bias_regularizer, kernel_constraint, bias_constraint: as in
            `keras.layers.EinsumDense`. Every kernel axis must be either contracted with the
            input or an output axis (not both). ``lora_rank``/``lora_alpha``/
            ``gptq_unpacked_column_size``/``quantization_config`` must be None.
        rank: number of carrier directions ``r``, ``1 ≤ r ≤ min(m, n)`` (checked at build).
        sparsity, power_iterations, warmup_steps, carrier_init, seed: as in `ReparamDense`.

    Reference: Yu, Zhang, Chen, Yin, Liu, "Large Scale Private Learning via Low-rank
    Reparametrization", ICML 2021; Ito et al., "Scaling Private Deep Learning with Low-Rank
    and Sparse Gradients", arXiv:2207.02699.
    """

    def __init__(
        self,
        equation,
        output_shape,
        activation=None,
        bias_axes=None,
        lora_rank=None,
        lora_alpha=None,
        gptq_unpacked_column_size=None,
        quantization_config=None,
        *,
        rank,
        **kwargs,
    ):
        specs = split_einsum_kernel_axes(equation)
        reject_unsupported(
            "ReparamEinsumDense",
            lora_rank=lora_rank,
            gptq_unpacked_column_size=gptq_unpacked_column_size,
            quantization_config=quantization_config,
        )
        super().__init__(rank=rank, **kwargs)
        self.equation = equation
        if isinstance(output_shape, int):
            self.partial_output_shape = (output_shape,)
        else:
            self.partial_output_shape = tuple(output_shape)
        self.bias_axes = bias_axes
        self.activation = activations.get(activation)
        input_spec, kernel_spec, output_spec, input_axes, output_axes = specs
        # The einsum equations of the two carrier products, with a fresh letter for rank.
        free = next(a for a in string.ascii_letters[::-1] if a not in equation)
        hidden_spec = "".join(a for a in output_spec if a not in output_axes) + free
        self._left_equation = f"{input_spec},{input_axes}{free}->{hidden_spec}"
        self._right_equation = f"{hidden_spec},{free}{output_axes}->{output_spec}"
        # Kernel axes reordered as (input axes..., output axes...) form the matrix view.
        self._matrix_perm = [kernel_spec.index(a) for a in input_axes + output_axes]
        self._num_input_axes = len(input_axes)

    def _kernel_initializer_for(self, input_axes, output_axes):
        # Mirrors EinsumDense: fan-in/fan-out of a VarianceScaling init over the right axes.
        init = self.kernel_initializer
        if not isinstance(init, initializers.VarianceScaling) or not hasattr(init, "input_axes"):
            return init
        if init.input_axes is not None and init.output_axes is not None:
            return init
        config = init.get_config()
        config["seed"] = init.seed
        config["input_axes"] = input_axes
        config["output_axes"] = output_axes
        return init.__class__.from_config(config)

    def build(self, input_shape):
        shape_data = _internals.analyze_einsum_string(
            self.equation, self.bias_axes, input_shape, self.partial_output_shape
        )
        kernel_shape, bias_shape = shape_data[0], shape_data[1]
        kernel_shape = tuple(int(d) for d in kernel_shape)
        self.input_spec = keras.layers.InputSpec(ndim=len(input_shape))
        kernel_initializer = self.kernel_initializer
        if len(shape_data) >= 5:
            kernel_initializer = self._kernel_initializer_for(shape_data[3], shape_data[4])
        self._add_kernel_and_bias(kernel_shape, bias_shape, kernel_initializer)
        permuted = [kernel_shape[i] for i in self._matrix_perm]
        input_dims = permuted[: self._num_input_axes]
        output_dims = permuted[self._num_input_axes :]
        self._permuted_kernel_shape = tuple(permuted)
        self._set_matrix_view(
            kernel_shape=kernel_shape,
            input_units_shape=input_dims,
            output_units_shape=output_dims,
            left_shape=(*input_dims, self.rank),
            right_shape=(self.rank, *output_dims),
            left_mask_shape=(*input_dims, 1),
            right_mask_shape=(1, *output_dims),
        )
        self._build_carriers()
        self.built = True

    def _kernel_as_matrix(self, kernel):
        return tf.reshape(tf.transpose(kernel, self._matrix_perm), self._matrix_shape)

    def _matrix_as_kernel(self, matrix):
        inverse = [self._matrix_perm.index(i) for i in range(len(self._matrix_perm))]
        return tf.transpose(tf.reshape(matrix, self._permuted_kernel_shape), inverse)

    def call(self, inputs, training=None):
        # tf.einsum, not ops.einsum: Keras' TF einsum rewrites some equations (e.g.
        # "abc,cde->abde") into reshape+matmul whose gradients come out wrong under
        # tf.vectorized_map, which the per-example-gradient fallback relies on.
        inputs = tf.convert_to_tensor(inputs)
        left, right = self._forward_carriers()
        hidden = tf.einsum(self._left_equation, tf.stop_gradient(inputs), left)
        x = tf.einsum(self.equation, inputs, self._frozen_kernel())
        x = ops.add(x, self._carrier_term(tf.einsum(self._right_equation, hidden, right)))
        return self._bias_and_activation(x)

    def ghost_call(self, ctx, inputs, training=None):
        """Ghost rule (``tf_dp.register_ghost_rule`` protocol): as ``call``; L's and R's
        per-example gradients are those of the two einsums (outer products over the shared
        axes), with LSG's frozen units zeroed in the factors."""
        if type(self).call is not ReparamEinsumDense.call:
            return NotImplemented
        x = ctx.batch_input(self, inputs)
        left_spec = parse_einsum(self._left_equation, x.shape.rank)
        kernel_spec = parse_einsum(self.equation, x.shape.rank)
        if left_spec is None or kernel_spec is None:
            return NotImplemented
        left, right, m_in, m_out = self._ghost_carriers(ctx, x)
        hidden = tf.einsum(self._left_equation, tf.stop_gradient(x), left)
        right_spec = parse_einsum(self._right_equation, hidden.shape.rank)
        if right_spec is None:
            return NotImplemented
        low_rank = tf.einsum(self._right_equation, hidden, right)
        z = tf.einsum(self.equation, x, ctx.read(self.kernel, x.dtype))
        z = z + self._carrier_term(low_rank)
        if self.bias is not None:
            z = z + ctx.read(self.bias, x.dtype)
        ctx.add(self.left_carrier, einsum_term(hidden, x, *left_spec, a_mask=m_in))
        ctx.add(self.right_carrier, einsum_term(low_rank, hidden, *right_spec, g_mask=m_out))
        if self.bias is not None:
            ctx.direct(self.bias, z, bias_grad_fn(kernel_spec[2], self.bias_axes))
        return self.activation(z) if self.activation is not None else z

    def compute_output_shape(self, input_shape):
        shape_data = _internals.analyze_einsum_string(
            self.equation, self.bias_axes, input_shape, self.partial_output_shape
        )
        return tuple(shape_data[2])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "output_shape": self.partial_output_shape,
                "equation": self.equation,
                "activation": activations.serialize(self.activation),
                "bias_axes": self.bias_axes,
            }
        )
        config.update(self._weight_options_config())
        return config
