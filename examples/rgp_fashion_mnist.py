r"""RGP and LSG vs DP-SGD on a ResNet-style CNN with GroupNormalization, at equal epsilon.

Three private training methods, sharing sigma, the sampling rate q and the number of steps
(hence the same epsilon, reported by the model's accountant after every epoch):

* ``dpsgd``: DP-SGD (momentum) with exact per-example clipping of every weight.
* ``rgp``: reparametrized gradient perturbation (Yu et al., ICML 2021): every Conv2D (and,
  with --reparam_classifier, the final Dense) is swapped for its Reparam* version by
  `tf_dp.layers.reparametrize(model, rank=r)`. Per-example gradients, clipping and noise
  act on the rank-r gradient carriers L, R (built from the historical update by one power
  iteration) instead of the kernels; W's update is rebuilt from the noised carrier
  gradients.
* ``lsg``: RGP plus the sparsity of Ito et al. ("Scaling Private Deep Learning with
  Low-Rank and Sparse Gradients"): a fraction p of the input and output units (the least
  important by sum |W|) is frozen in every step, so the noise lands on fewer coordinates.

The model has no BatchNormalization (its batch statistics mix examples; tf_dp refuses it).
The default data set, Fashion-MNIST, is on this machine; --dataset=cifar10 or svhn_cropped
with --model=wrn (WRN-28-4 as in the RGP paper) read a prepared tensorflow-datasets copy
from --data_dir when there is one (nothing is downloaded).

  python examples/rgp_fashion_mnist.py --method=dpsgd
  python examples/rgp_fashion_mnist.py --method=rgp --rank=8
  python examples/rgp_fashion_mnist.py --method=lsg --rank=8 --sparsity=0.5
  python examples/rgp_fashion_mnist.py --method=rgp --widths=16,32,64 --nostem_pool  # small
  python examples/rgp_fashion_mnist.py --target_epsilon=3 --epochs=8   # calibrates sigma
  python examples/rgp_fashion_mnist.py --dataset=cifar10 --model=wrn --depth=28 --width=4

Results of the three methods at epsilon ~ 3 are in docs/rgp_results.md.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

from tf_dp.accounting.functions import epsilon_text  # noqa: E402
from _report import fit_and_report  # noqa: E402  (examples/_report.py)
from tf_dp.accounting import calibrate_noise_multiplier, compute_epsilon  # noqa: E402
from tf_dp.layers import reparam_layers, reparametrize  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("method", "rgp", ["dpsgd", "rgp", "lsg", "nonprivate"],
                  "Training method; nonprivate is plain SGD (a reference, no epsilon).")
flags.DEFINE_integer("rank", 8, "Carrier rank r (rgp, lsg).")
flags.DEFINE_float("sparsity", 0.5, "LSG fraction p of input/output units frozen (lsg only).")
flags.DEFINE_integer("warmup_steps", 0, "Steps whose carriers come from W instead of W - W0.")
flags.DEFINE_bool("reparam_classifier", False,
                  "Also reparametrize the final Dense layer (rgp, lsg); default: Conv2D only.")
flags.DEFINE_integer("epochs", 5, "Epochs (of round(N / batch_size) Poisson-sampled steps).")
flags.DEFINE_integer("batch_size", 512, "Expected batch size (Poisson sampling, q = B / N).")
flags.DEFINE_float("noise_multiplier", 0.723,
                   "Noise multiplier sigma (0.723: epsilon 3.0 at delta 1e-5 for the default "
                   "batch and epochs on Fashion-MNIST).")
flags.DEFINE_float("target_epsilon", None,
                   "If set, sigma is calibrated to reach it (overrides --noise_multiplier).")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clipping norm C.")
flags.DEFINE_float("learning_rate", 1.0, "Learning rate (SGD with momentum; 1 was better than 2 "
                   "for all three methods, docs/rgp_results.md).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_float("delta", 1e-5, "Target delta.")
flags.DEFINE_integer("seed", 0, "Seed for initialisation and carriers only. Noise and Poisson "
                     "sampling always come from fresh OS entropy.")
flags.DEFINE_enum("dataset", "fashion_mnist", ["fashion_mnist", "cifar10", "svhn_cropped"],
                  "Data set; cifar10 / svhn_cropped need a prepared tfds copy in --data_dir.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory (cifar10, svhn).")
flags.DEFINE_enum("model", "resnet", ["resnet", "wrn"],
                  "resnet: small ResNet (--widths); wrn: wide ResNet (--depth, --width).")
flags.DEFINE_list("widths", ["32", "64", "128"],
                  "Channels of the resnet's stages (the measured comparison in "
                  "docs/rgp_results.md; 16,32,64 without --stem_pool is the small model).")
flags.DEFINE_integer("blocks", 1, "Residual blocks per stage (resnet).")
flags.DEFINE_bool("stem_pool", True,
                  "2x2 max-pooling after the resnet's stem: a quarter of the activations, so "
                  "wider stages (e.g. --widths=32,64,128) cost about what 16/32/64 cost without.")
flags.DEFINE_integer("depth", 28, "WRN depth (6n + 4).")
flags.DEFINE_integer("width", 4, "WRN widening factor.")
flags.DEFINE_integer("groups", 4, "GroupNormalization groups.")


# ----------------------------------------------------------------------------- data


def load_data(name, data_dir):
    """((x_train, y_train), (x_test, y_test)), images float32 in [0, 1], NHWC."""
    if name == "fashion_mnist":
        (x_train, y_train), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist")
        x_train, x_test = x_train[..., None], x_test[..., None]
    else:
        (x_train, y_train), (x_test, y_test) = _load_tfds(name, data_dir)
    return ((x_train.astype("float32") / 255.0, y_train.astype("int64")),
            (x_test.astype("float32") / 255.0, y_test.astype("int64")))


def _load_tfds(name, data_dir):
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise SystemExit(f"--dataset={name} needs tensorflow-datasets: {err}") from err
    try:
        train, test = tfds.load(name, split=["train", "test"], batch_size=-1,
                                as_supervised=True, download=False, data_dir=data_dir)
    except Exception as err:  # tfds raises several types for a missing copy
        raise SystemExit(
            f"--dataset={name}: no prepared tensorflow-datasets copy in --data_dir="
            f"{data_dir or '~/tensorflow_datasets'} ({type(err).__name__}: "
            f"{str(err).splitlines()[0]}). Prepare it with `tfds build {name}` on a machine "
            "with network access and copy the directory here.") from err
    return tuple(tuple(np.asarray(a) for a in tfds.as_numpy(split)) for split in (train, test))


# ----------------------------------------------------------------------------- models


def _conv(filters, kernel, stride, name):
    return keras.layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                               kernel_initializer="he_normal", name=name)


def _basic_block(x, filters, stride, groups, name):
    """conv-GN-relu-conv-GN plus shortcut (1x1 conv when the shape changes), relu."""
    y = _conv(filters, 3, stride, f"{name}_conv1")(x)
    y = keras.layers.GroupNormalization(groups, name=f"{name}_gn1")(y)
    y = keras.layers.Activation("relu")(y)
    y = _conv(filters, 3, 1, f"{name}_conv2")(y)
    y = keras.layers.GroupNormalization(groups, name=f"{name}_gn2")(y)
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = _conv(filters, 1, stride, f"{name}_shortcut")(x)
    # keras.layers.Add, not `y + shortcut`: reparametrize() clones the model layer by layer
    # and fails on operator nodes (see docs/rgp_results.md, "Bugs").
    return keras.layers.Activation("relu")(keras.layers.Add()([y, shortcut]))


def small_resnet(input_shape, widths, blocks, groups, stem_pool=False,
                 num_classes=10) -> keras.Model:
    """A ResNet-style CNN: stride-2 stem, one stage per width (stride 2 after the first)."""
    inputs = keras.Input(input_shape)
    x = _conv(widths[0], 3, 2, "stem")(inputs)
    x = keras.layers.GroupNormalization(groups, name="stem_gn")(x)
    x = keras.layers.Activation("relu")(x)
    if stem_pool:
        x = keras.layers.MaxPooling2D(2, name="stem_pool")(x)
    for i, filters in enumerate(widths):
        for j in range(blocks):
            stride = 2 if (i > 0 and j == 0) else 1
            x = _basic_block(x, filters, stride, groups, f"stage{i}_block{j}")
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes, name="classifier")(x))


def _wide_block(x, filters, stride, groups, name):
    """Pre-activation WRN block (GN-relu-conv-GN-relu-conv) with a 1x1 projection."""
    y = keras.layers.GroupNormalization(groups, name=f"{name}_gn1")(x)
    y = keras.layers.Activation("relu")(y)
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = _conv(filters, 1, stride, f"{name}_shortcut")(y)
    y = _conv(filters, 3, stride, f"{name}_conv1")(y)
    y = keras.layers.GroupNormalization(groups, name=f"{name}_gn2")(y)
    y = keras.layers.Activation("relu")(y)
    y = _conv(filters, 3, 1, f"{name}_conv2")(y)
    return keras.layers.Add()([y, shortcut])


def wide_resnet(input_shape, depth, width, groups, num_classes=10) -> keras.Model:
    """WRN-depth-width (Zagoruyko & Komodakis 2016) with GroupNormalization, as in RGP §5."""
    if (depth - 4) % 6:
        raise ValueError(f"`depth` must be 6n + 4, got {depth}")
    n = (depth - 4) // 6
    inputs = keras.Input(input_shape)
    x = _conv(16, 3, 1, "stem")(inputs)
    for i, filters in enumerate((16 * width, 32 * width, 64 * width)):
        for j in range(n):
            stride = 2 if (i > 0 and j == 0) else 1
            x = _wide_block(x, filters, stride, groups, f"stage{i}_block{j}")
    x = keras.layers.GroupNormalization(groups, name="final_gn")(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes, name="classifier")(x))


def build_model(input_shape) -> keras.Model:
    if FLAGS.model == "wrn":
        model = wide_resnet(input_shape, FLAGS.depth, FLAGS.width, FLAGS.groups)
    else:
        model = small_resnet(input_shape, [int(w) for w in FLAGS.widths], FLAGS.blocks,
                             FLAGS.groups, FLAGS.stem_pool)
    if FLAGS.method not in ("rgp", "lsg"):
        return model
    # Only where the carriers are smaller than the kernel, r (m + n) < m n (the 3x3x1 -> 16
    # stem, for instance, has fewer weights than its rank-8 carriers and stays plain).
    names = [layer.name for layer in model.layers
             if type(layer) is keras.layers.Conv2D and _carriers_save(*_matrix_dims(layer))]
    if FLAGS.reparam_classifier:
        names.append("classifier")
    return reparametrize(model, rank=FLAGS.rank,
                         sparsity=FLAGS.sparsity if FLAGS.method == "lsg" else None,
                         layers=names, warmup_steps=FLAGS.warmup_steps, seed=FLAGS.seed)


def _matrix_dims(conv):
    kh, kw, c_in, c_out = conv.kernel.shape
    return kh * kw * c_in, c_out


def _carriers_save(m, n):
    return FLAGS.rank <= min(m, n) and FLAGS.rank * (m + n) < m * n


# ----------------------------------------------------------------------------- training


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = load_data(FLAGS.dataset, FLAGS.data_dir)
    n = len(x_train)
    q = FLAGS.batch_size / n
    steps = FLAGS.epochs * max(1, round(1.0 / q))  # PoissonSampler's steps per epoch
    sigma = FLAGS.noise_multiplier
    if FLAGS.target_epsilon is not None:
        sigma = calibrate_noise_multiplier(sampling_probability=q, steps=steps,
                                           target_epsilon=FLAGS.target_epsilon, delta=FLAGS.delta)
    private = FLAGS.method != "nonprivate"
    model = build_model(x_train.shape[1:])
    swapped = reparam_layers(model)
    if private:
        model = tf_dp.keras.make_private(model, delta=FLAGS.delta)
        optimizer = tf_dp.DPSGD(FLAGS.l2_norm_clip, sigma, learning_rate=FLAGS.learning_rate,
                                momentum=FLAGS.momentum)
    else:
        optimizer = keras.optimizers.SGD(FLAGS.learning_rate, momentum=FLAGS.momentum)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    # Noised coordinates per step: what RGP / LSG shrink (LSG counts only unfrozen entries).
    plain = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    kernels = sum(int(np.prod(layer.kernel.shape)) for layer in swapped)
    carriers = sum(int(np.sum(np.broadcast_to(mask.numpy(), var.shape)))
                   for layer in swapped
                   for var, mask in zip(layer.carrier_variables(), layer.noise_masks()))
    shape = (f"widths {'/'.join(FLAGS.widths)}, {FLAGS.blocks} block(s) per stage"
             + (", stem pooling" if FLAGS.stem_pool else "") if FLAGS.model == "resnet"
             else f"WRN-{FLAGS.depth}-{FLAGS.width}")
    print(f"{FLAGS.dataset}: {n} train / {len(x_test)} test; {FLAGS.model} ({shape}, "
          f"GroupNorm({FLAGS.groups})) with {plain} trainable weights; method {FLAGS.method}")
    if swapped:
        print(f"reparametrized {len(swapped)} layers at rank {FLAGS.rank}"
              + (f", LSG sparsity {FLAGS.sparsity}" if FLAGS.method == "lsg" else "")
              + f": noised coordinates {plain - kernels + carriers} instead of {plain}")
    if private:
        planned = compute_epsilon(noise_multiplier=sigma, sampling_probability=q, steps=steps,
                                  delta=FLAGS.delta)
        print(f"sigma {sigma:.4f}  C {FLAGS.l2_norm_clip}  q {q:.5f}  steps {steps}  "
              f"planned epsilon {epsilon_text(planned)} "
              f"at delta {FLAGS.delta:g}")
    print(f"batch {FLAGS.batch_size}  epochs {FLAGS.epochs}  lr {FLAGS.learning_rate}  "
          f"momentum {FLAGS.momentum}  seed {FLAGS.seed}", flush=True)

    fit_and_report(model, (x_train, y_train), (x_test, y_test), FLAGS.batch_size, FLAGS.epochs,
                   private, FLAGS.delta)

if __name__ == "__main__":
    app.run(main)
