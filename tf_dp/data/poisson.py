"""Poisson sampling for tf.data, the sampling the privacy accountant assumes."""

from __future__ import annotations

import math
import weakref

import numpy as np
import tensorflow as tf

from tf_dp import _validation
from tf_dp.core import randomness

# Datasets made by PoissonSampler.dataset(), mapped to their sampler: fit() recognises them
# (and datasets derived from them by per-batch transformations) and takes q from here, never
# from a cardinality.
_SAMPLED = weakref.WeakKeyDictionary()

# Transformations after which every element is still one Poisson sample of the data (as long
# as a map acts on each example of the batch separately: see docs/privacy.md).
_KEEPS_SAMPLING = ("MapDataset", "ParallelMapDataset", "PrefetchDataset", "TakeDataset",
                   "_OptionsDataset", "OptionsDataset", "RepeatDataset", "_PrefetchDataset",
                   "_MapDataset", "_ParallelMapDataset", "_TakeDataset", "_RepeatDataset")


class PoissonSampler:
    """Batches in which every example is included independently with probability q.

    Each element is one logical batch, a Poisson sample of the data set (with gradient
    accumulation the private train step splits it into disjoint micro-batches, so no
    example appears twice in one logical step). Batch sizes vary (the batch axis is ``None``,
    so Keras traces the train step once); ``pad_to`` pads every batch to a static size with
    sample weight 0 for XLA or other static-shape needs, and raises if a sample exceeds it.

    Args:
      x, y, sample_weight: arrays (or nested structures of arrays) with N examples.
      expected_batch_size: expected logical batch size q*N (give this or
        ``sampling_probability``).
      sampling_probability: q in (0, 1].
      steps_per_epoch: logical steps per epoch; default round(1/q).
      pad_to: optional static (logical) batch size: batches are padded to it with weight-0
        rows; a sample larger than it raises an error. "auto": the smallest size a batch
        exceeds with probability below 1e-9 (``safe_pad_to``).
      seed: debugging only. None (default): which examples are sampled is drawn from fresh
        OS entropy, never saved or replayed. An int makes the samples a public function of
        the seed, which voids the amplification by sampling the accountant counts (a warning
        says so).

    Reference: Abadi et al. 2016 and Mironov, Talwar, Zhang 2019 (sampled Gaussian
    mechanism): the accounting assumes exactly this sampling.
    """

    def __init__(self, x, y=None, sample_weight=None, expected_batch_size=None,
                 sampling_probability=None, steps_per_epoch=None, pad_to=None, seed=None):
        leaves = [np.asarray(a) for a in tf.nest.flatten(x)]
        if not leaves:
            raise ValueError("`x` is empty.")
        n = len(leaves[0])
        for other in tf.nest.flatten((x, y, sample_weight)):
            if other is not None and len(other) != n:
                raise ValueError(f"All arrays must have the same length; got {len(other)} and "
                                 f"{n}.")
        if n == 0:
            raise ValueError("`x` has no examples.")
        if (expected_batch_size is None) == (sampling_probability is None):
            raise ValueError("Give exactly one of `expected_batch_size` and "
                             "`sampling_probability`.")
        if sampling_probability is None:
            if not expected_batch_size > 0:
                raise ValueError(f"`expected_batch_size` must be > 0, got "
                                 f"{expected_batch_size}.")
            sampling_probability = expected_batch_size / n
        sampling_probability = _validation.sampling_probability(sampling_probability)
        if pad_to == "auto":
            pad_to = safe_pad_to(n, sampling_probability)
        elif pad_to is not None:
            pad_to = _validation.positive_int(pad_to, "pad_to")
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.dataset_size = n
        self.sampling_probability = float(sampling_probability)
        self.steps_per_epoch = steps_per_epoch or max(1, round(1.0 / self.sampling_probability))
        self.pad_to = pad_to
        self.seed = _validation.seed(seed)
        if seed is not None:
            randomness.warn_seeded("PoissonSampler", seed)
        # Every logical batch takes a fresh seed from this stream (a counter that only goes
        # forward), so iterating a dataset twice, or calling dataset() twice, never repeats a
        # sample.
        self._stream = randomness.SecretStream("poisson", seed)

    @property
    def expected_batch_size(self) -> float:
        """q * N: the denominator of the private mean, never the realised size."""
        return self.sampling_probability * self.dataset_size

    def dataset(self, num_steps=None) -> tf.data.Dataset:
        """Batches ``(x, y[, sample_weight])``; endless unless ``num_steps`` is given."""
        n, q = self.dataset_size, self.sampling_probability
        data = tf.nest.map_structure(lambda a: None if a is None else tf.constant(np.asarray(a)),
                                     (self.x, self.y, self.sample_weight))
        stream, pad_to = self._stream, self.pad_to

        def logical(step):
            del step
            u = tf.random.stateless_uniform([n], seed=stream.next_seed())
            idx = tf.cast(tf.where(u < q)[:, 0], tf.int32)
            return _gather(data, idx, pad_to)

        steps = tf.data.Dataset.range(num_steps) if num_steps is not None else (
            tf.data.Dataset.range(2**62))
        # Sequential map: with a debugging seed the order of the draws is reproducible.
        ds = steps.map(logical).prefetch(2)
        _SAMPLED[ds] = self
        return ds


def sampler_of(dataset):
    """The PoissonSampler a dataset was made by, through per-batch transformations (map,
    prefetch, take, repeat, options), or None if it was not made by one.

    Raises:
      ValueError: if it was made by one but then transformed in a way that no longer keeps
        each element a Poisson sample (batch/unbatch, shuffle across batches, cache — which
        would replay samples —, filter, zip, concatenate, ...).
    """
    chain = []
    node = dataset
    while node is not None:
        if node in _SAMPLED:
            bad = [type(d).__name__ for d in chain if type(d).__name__ not in _KEEPS_SAMPLING]
            if bad:
                raise ValueError(
                    "tf_dp: this dataset comes from a PoissonSampler but was then transformed "
                    f"by {bad}, after which its batches are no longer the Poisson samples the "
                    "accountant counts. Only per-batch map (acting on each example "
                    "separately), prefetch, take and repeat keep the sampling; apply other "
                    "transformations to the data before the sampler.")
            return _SAMPLED[node]
        chain.append(node)
        try:
            inputs = node._inputs()  # tf.data's own lineage of a transformed dataset
        except Exception:  # noqa: BLE001 (a source dataset, or a type without lineage)
            return None
        node = inputs[0] if len(inputs) == 1 else None
    return None


def _gather(data, part, pad_to):
    x, y, sw = data
    take = lambda s: tf.nest.map_structure(lambda a: None if a is None else tf.gather(a, part), s)
    xb, yb = take(x), take(y)
    swb = None if sw is None else tf.cast(tf.gather(sw, part), tf.float32)
    if pad_to is None:
        return (xb, yb) if swb is None else (xb, yb, swb)
    m = tf.shape(part)[0]
    check = tf.debugging.assert_less_equal(
        m, pad_to, message="tf_dp: a Poisson batch exceeded `pad_to`; raise `pad_to`.")
    with tf.control_dependencies([check]):
        m = tf.identity(m)
    weight = tf.ones([m], tf.float32) if swb is None else swb

    def pad(a):
        padded = tf.concat([a, tf.zeros(tf.concat([[pad_to - m], tf.shape(a)[1:]], 0), a.dtype)],
                           axis=0)
        return tf.ensure_shape(padded, [pad_to] + a.shape[1:].as_list())

    xb = tf.nest.map_structure(pad, xb)
    yb = tf.nest.map_structure(lambda a: None if a is None else pad(a), yb)
    return xb, yb, pad(weight)


#: "auto" padding: the probability that a Poisson batch exceeds it, per batch.
_PAD_TAIL = 1e-9


def safe_pad_to(dataset_size: int, sampling_probability: float, tail: float = _PAD_TAIL) -> int:
    """The smallest b with P(Binomial(N, q) > b) < ``tail``: a static batch size that a
    Poisson batch exceeds (and then stops training with an error) with probability below
    ``tail`` per batch. Depends on N and q only, never on the data."""
    from scipy import stats

    b = int(stats.binom.isf(tail, int(dataset_size), float(sampling_probability)))
    while stats.binom.sf(b, int(dataset_size), float(sampling_probability)) >= tail:
        b += 1
    return max(1, min(b, int(dataset_size)))


def expected_steps(dataset_size: int, expected_batch_size: float, epochs: float) -> int:
    """Logical steps in ``epochs`` epochs at expected batch size ``expected_batch_size``."""
    return int(math.ceil(epochs * max(1, round(dataset_size / expected_batch_size))))
