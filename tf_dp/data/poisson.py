"""Poisson sampling for tf.data, the sampling the privacy accountant assumes."""

from __future__ import annotations

import math
import numbers
import weakref

import numpy as np
import tensorflow as tf

from tf_dp import _validation
from tf_dp.core import randomness
from tf_dp.schedules import PiecewiseBatchSize

# Datasets made by PoissonSampler.dataset(), mapped to their sampler: fit() recognises them
# (and datasets derived from them by per-batch transformations) and takes q from here, never
# from a cardinality.
_SAMPLED = weakref.WeakKeyDictionary()

# Transformations after which every element is still one Poisson sample of the data (as long
# as a map acts on each example of the batch separately: see docs/privacy.md).
_KEEPS_SAMPLING = ("MapDataset", "ParallelMapDataset", "PrefetchDataset", "TakeDataset",
                   "_OptionsDataset", "OptionsDataset", "RepeatDataset", "_PrefetchDataset",
                   "_MapDataset", "_ParallelMapDataset", "_TakeDataset", "_RepeatDataset")

# A dataset whose last transformation is one of these yields batches, not examples.
_BATCHING = ("BatchDataset", "_BatchDataset", "PaddedBatchDataset", "_PaddedBatchDataset",
             "_RaggedBatchDataset", "_DenseToRaggedDataset", "ParallelBatchDataset",
             "_ParallelBatchDataset")

# Rows a dataset source shows as `x`, `y`, `sample_weight` (fit's independence check reads
# a few of them before training).
_HEAD_ROWS = 32
# A dataset source is read in chunks of at most this many bytes (and 1024 examples): one
# stateless uniform draw per chunk decides which of its examples are kept.
_CHUNK_BYTES = 8 << 20
_MAX_CHUNK = 1024


#: PoissonSampler attributes fixed when it is created (what the accounting and every
#: dataset read); ``schedule`` and ``pad_to`` are fixed once ``dataset()`` is called.
_FROZEN_AT_CREATION = ("sampling_probability", "dataset_size", "seed", "_stream",
                       "_order_stream", "_source")


class PoissonSampler:
    """Batches in which every example is included independently with probability q.

    Each element is one logical batch, a Poisson sample of the data set (with gradient
    accumulation the private train step splits it into disjoint micro-batches, so no
    example appears twice in one logical step). Batch sizes vary, and a batch may be empty:
    that step still happens (the accountant counts it, and its update is noise alone).

    The data come from one of two sources:

    * **arrays** (numpy arrays, ``np.load(path, mmap_mode="r")`` memmaps, anything
      ``np.asarray`` accepts; nested structures of them): held by reference, never copied
      into the graph; each step draws the sampled indices and reads only those rows
      (``np.take``), so a memmap is a file-backed source of any size.
    * **a** ``tf.data.Dataset`` **of examples** (``TFRecordDataset(...).map(parse)``, ...),
      each element one example ``(x, y)``, ``(x, y, sample_weight)`` or ``x``, of a fixed
      shape. Each logical step is one pass over the whole source, keeping every element
      independently with probability q: a step costs reading N examples, not q*N. N must
      be exact (q*N is the denominator of the private mean): the dataset's cardinality when
      known, else ``dataset_size``; every pass checks that the source yields exactly N.

    Per-example maps after the sampler (augmentation) keep q:
    ``fit(sampler.dataset().map(augment))``, where ``augment`` acts on each example of the
    batch alone (docs/sampling.md).

    ``pad_to`` pads every batch with sample weight 0 rows to a multiple of ``pad_to``:
    ``pad_to`` itself unless the batch is larger, then the next multiple (never truncated:
    dropping sampled examples would change the mechanism the accountant counts). With
    ``fit(max_physical_batch_size=pad_to)`` every physical batch then has ``pad_to`` rows.
    A padded batch's rows, examples and padding, are in a secret uniformly random order
    (fresh OS entropy, a permutation per step): with the batch's shape fixed, no example's
    row then follows how many examples precede it, so adding an example leaves every other
    example's computation unchanged, whatever the kernels do with a row's position
    (docs/privacy.md, "An example's gradient must not depend on its batch's size").

    ```
    for each logical step t:
        seed_t = next seed of a secret stream (fresh OS entropy)
        keep example i iff  uniform(seed_t, i) < q       # independently for i = 1..N
        batch = the kept examples (+ weight-0 rows up to a multiple of pad_to, and then
                all rows in a secret random order)
    ```

    Args:
      x: arrays (or a nested structure of arrays) with N examples, or a
        ``tf.data.Dataset`` whose elements are single examples.
      y, sample_weight: arrays with N examples (array sources only; a dataset's elements
        carry their own).
      expected_batch_size: expected logical batch size q*N (give this or
        ``sampling_probability``), or a batch-size schedule
        (``tf_dp.schedules.PiecewiseBatchSize``): step t is then sampled at its own
        q_t = size_t / N and every element is ``(batch, phase)``, the index of the schedule's
        phase the batch was sampled in (which fit divides and accounts by).
      sampling_probability: q in (0, 1].
      steps_per_epoch: logical steps per epoch; default round(1/q).
      pad_to: optional padded (logical) batch size: batches are padded with weight-0 rows to
        a multiple of it (``pad_to`` itself unless the sample is larger). "auto": the
        smallest size a batch exceeds with probability below 1e-9 (``safe_pad_to``).
      seed: debugging only. None (default): which examples are sampled is drawn from fresh
        OS entropy, never saved or replayed. An int makes the samples a public function of
        the seed, which voids the amplification by sampling the accountant counts (a warning
        says so).
      dataset_size: N for a dataset source whose cardinality TensorFlow does not know
        (``filter``, ``from_generator``, files, ...); checked against the cardinality when
        known, and against the length of arrays.

    Reference: Abadi et al. 2016 and Mironov, Talwar, Zhang 2019 (sampled Gaussian
    mechanism): the accounting assumes exactly this sampling. Opacus' ``DPDataLoader`` is
    the PyTorch counterpart.
    """

    def __init__(self, x, y=None, sample_weight=None, expected_batch_size=None,
                 sampling_probability=None, steps_per_epoch=None, pad_to=None, seed=None,
                 dataset_size=None):
        if isinstance(x, tf.data.Dataset):
            if y is not None or sample_weight is not None:
                raise ValueError("`y` and `sample_weight` are for array sources; a dataset "
                                 "source carries them in its elements: (x, y) or "
                                 "(x, y, sample_weight).")
            n = _source_size(x, dataset_size)
            self._source = _DatasetSource(x, n)
        else:
            self._source = _ArraySource(x, y, sample_weight)
            n = self._source.size
            if dataset_size is not None and _validation.positive_int(
                    dataset_size, "dataset_size") != n:
                raise ValueError(f"`dataset_size` must be the number of examples ({n}), got "
                                 f"{dataset_size!r}.")
        if (expected_batch_size is None) == (sampling_probability is None):
            raise ValueError("Give exactly one of `expected_batch_size` and "
                             "`sampling_probability`.")
        self.schedule = None
        if isinstance(expected_batch_size, PiecewiseBatchSize):
            self.schedule = expected_batch_size
            if pad_to is not None:
                raise ValueError("`pad_to` is not supported with a batch-size schedule; use "
                                 "fit(max_physical_batch_size=...) to bound memory.")
            too_big = [b for b in self.schedule.batch_sizes if b > n]
            if too_big:
                raise ValueError(f"`expected_batch_size` schedule has sizes {too_big} above the "
                                 f"number of examples {n}.")
            expected_batch_size = self.schedule.batch_sizes[0]
        if sampling_probability is None:
            if not expected_batch_size > 0:
                raise ValueError(f"`expected_batch_size` must be > 0, got "
                                 f"{expected_batch_size}.")
            sampling_probability = expected_batch_size / n
        requested = _validation.sampling_probability(sampling_probability)
        sampling_probability = exact_rate(requested)
        if pad_to == "auto":
            pad_to = safe_pad_to(n, sampling_probability)
        elif pad_to is not None:
            pad_to = _validation.positive_int(pad_to, "pad_to")
        self.dataset_size = n
        #: q (of the first phase, with a schedule).
        self.sampling_probability = float(sampling_probability)
        # (from the q asked for: 1 / exact_rate(q) can fall on the other side of a .5)
        self.steps_per_epoch = steps_per_epoch or max(1, round(1.0 / requested))
        self.pad_to = pad_to
        self.seed = _validation.seed(seed)
        if seed is not None:
            randomness.warn_seeded("PoissonSampler", seed)
        # Every logical batch takes a fresh seed from this stream (a counter that only goes
        # forward), so iterating a dataset twice, or calling dataset() twice, never repeats a
        # sample.
        self._stream = randomness.SecretStream("poisson", seed)
        # The order of a padded batch's rows: a stream of its own, so that the samples of a
        # seeded (debugging) sampler are the same with and without pad_to.
        self._order_stream = randomness.SecretStream("poisson_order", seed)
        object.__setattr__(self, "_frozen", set(_FROZEN_AT_CREATION))

    def __setattr__(self, name, value):
        # What the accounting reads (q, N, the schedule's rates) must be what the datasets
        # sample at: a q lowered after dataset() was built was accounted while the batches
        # kept the old rate (session 13 audit: epsilon 0.46 reported for 15.1).
        if name in getattr(self, "_frozen", ()):
            raise AttributeError(
                f"PoissonSampler.{name} cannot be changed after "
                + ("creation" if name in _FROZEN_AT_CREATION else "dataset() was called")
                + ": the datasets sample at the values they were made with, and fit() "
                "accounts what the sampler says; create a new PoissonSampler instead.")
        object.__setattr__(self, name, value)

    @property
    def source(self):
        """The ``tf.data.Dataset`` of examples, or the ``(x, y, sample_weight)`` arrays."""
        return self._source.data

    @property
    def x(self):
        """The inputs (array source), or those of the source's first examples (at most 32,
        batched; a dataset source), for checks that read rows ahead of training."""
        return self._source.head()[0]

    @property
    def y(self):
        """As ``x``, for the targets (None if there are none)."""
        return self._source.head()[1]

    @property
    def sample_weight(self):
        """As ``x``, for the sample weights (None if there are none)."""
        return self._source.head()[2]

    @property
    def phase_probabilities(self) -> tuple:
        """q of every phase of the schedule (one entry without a schedule)."""
        if self.schedule is None:
            return (self.sampling_probability,)
        return tuple(exact_rate(b / self.dataset_size) for b in self.schedule.batch_sizes)

    @property
    def phase_batch_sizes(self) -> tuple:
        """q*N of every phase of the schedule (one entry without a schedule)."""
        return tuple(q * self.dataset_size for q in self.phase_probabilities)

    @property
    def expected_batch_size(self) -> float:
        """q * N: the denominator of the private mean, never the realised size."""
        return self.sampling_probability * self.dataset_size

    def dataset(self, num_steps=None, first_step=0) -> tf.data.Dataset:
        """Batches ``(x, y[, sample_weight])``; endless unless ``num_steps`` is given.

        Every element is one logical step, an empty batch included. With ``pad_to`` the
        third part is always there (weight 0 on padding rows) and every batch has a
        multiple of ``pad_to`` rows; its batch axis is static only when ``pad_to >= N``.

        ``first_step``: with a batch-size schedule, the logical step number of the first
        element (its phase follows it): an integer >= 0, or an integer ``tf.Variable`` read
        when the first element is made (``fit`` continues a schedule from the optimizer's
        step count, restored or not). Ignored without a schedule.
        """
        self._frozen.update(("schedule", "pad_to"))  # now in this dataset's sampling
        n, pad_to = self.dataset_size, self.pad_to
        steps = tf.data.Dataset.range(num_steps) if num_steps is not None else (
            tf.data.Dataset.range(2**62))
        # One element per step, in order (sequential): with a debugging seed the order of the
        # draws is reproducible.
        if self.schedule is None:
            samples = self._source.samples(steps, lambda step: self.sampling_probability,
                                           self._stream)
            order = self._order_stream
            ds = samples.map(lambda x, y, sw: _finish((x, y, sw), pad_to,
                                                       static=pad_to is not None and pad_to >= n,
                                                       order=order))
        else:
            if isinstance(first_step, tf.Variable):
                # Read once, when the first element is made (not when the dataset is).
                count = 2**62 if num_steps is None else int(num_steps)
                steps = tf.data.Dataset.from_tensors(0).map(
                    lambda _: tf.cast(first_step.read_value(), tf.int64)).flat_map(
                        lambda start: tf.data.Dataset.range(start, start + count))
            else:
                if (isinstance(first_step, bool) or not isinstance(first_step, numbers.Integral)
                        or first_step < 0):
                    raise ValueError(f"`first_step` must be an integer >= 0 or a tf.Variable, "
                                     f"got {first_step!r}.")
                steps = steps.map(lambda step: step + int(first_step))
            boundaries = tf.constant(self.schedule.boundaries or [2**62], tf.int64)
            qs = tf.constant(self.phase_probabilities, tf.float64)
            phase_of = lambda step: tf.cast(tf.searchsorted(
                boundaries, tf.reshape(tf.cast(step, tf.int64), [1]), side="right")[0],
                tf.int32)
            # The phase travels with its batch: fit divides and accounts by the q the batch
            # was actually sampled at, whatever happens to the step count in between.
            steps = steps.map(phase_of)
            samples = self._source.samples(steps, lambda phase: tf.gather(qs, phase),
                                           self._stream, with_step=True)
            ds = samples.map(lambda x, y, sw, phase: (_finish((x, y, sw), None, False), phase))
        ds = ds.prefetch(2)
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


#: "auto" padding: the probability that a Poisson batch exceeds it, per batch.
_PAD_TAIL = 1e-9


def safe_pad_to(dataset_size: int, sampling_probability: float, tail: float = _PAD_TAIL) -> int:
    """The smallest b with P(Binomial(N, q) > b) < ``tail``: a padded batch size that a
    Poisson batch exceeds (and is then padded to a multiple of b) with probability below
    ``tail`` per batch. Depends on N and q only, never on the data."""
    from scipy import stats

    b = int(stats.binom.isf(tail, int(dataset_size), float(sampling_probability)))
    while stats.binom.sf(b, int(dataset_size), float(sampling_probability)) >= tail:
        b += 1
    return max(1, min(b, int(dataset_size)))


def expected_steps(dataset_size: int, expected_batch_size: float, epochs: float) -> int:
    """Logical steps in ``epochs`` epochs at expected batch size ``expected_batch_size``."""
    return int(math.ceil(epochs * max(1, round(dataset_size / expected_batch_size))))


# ------------------------------------------------------------------ sources and padding


class _ArraySource:
    """Arrays held by reference (a memmap stays on disk): a sample reads only its rows."""

    def __init__(self, x, y, sample_weight):
        self.data = (x, y, sample_weight)
        # tf.data would stack a Python list of tensors into one tensor: a list of inputs (a
        # multi-input model, as Keras accepts) travels as a tuple.
        self._arrays = tf.nest.map_structure(lambda a: None if a is None else _as_array(a),
                                             _lists_to_tuples(self.data))
        leaves = [a for a in tf.nest.flatten(self._arrays[0]) if a is not None]
        if not leaves:
            raise ValueError("`x` is empty.")
        n = len(leaves[0])
        for other in tf.nest.flatten(self._arrays):
            if other is not None and len(other) != n:
                raise ValueError(f"All arrays must have the same length; got {len(other)} and "
                                 f"{n}.")
        if n == 0:
            raise ValueError("`x` has no examples.")
        for name, part in zip(("x", "y", "sample_weight"), self._arrays):
            check_text(name, part)
        self.size = n

    def head(self):
        return self.data

    def samples(self, steps, q_of, stream, with_step=False):
        """``(x, y, sample_weight)`` of one Poisson sample per element of ``steps``, at rate
        ``q_of(step)`` (and the step element appended with ``with_step``)."""
        def sample(step):
            u = randomness.uniform(stream.next_seed(), [self.size])
            rows = _take_rows(self._arrays, tf.where(u < tf.cast(q_of(step), tf.float64))[:, 0])
            return (*rows, step) if with_step else rows

        return steps.map(sample)


def check_text(name: str, arrays) -> None:
    """Raises ``ValueError`` naming ``name`` if a str/object array in ``arrays`` holds a
    value that is not text or bytes, or text that is not UTF-8-encodable: read only when a
    sample drew its row, it would stop training exactly when that example was sampled
    (session 22 audit). Checked once, before any step."""
    for a in tf.nest.flatten(arrays):
        if a is None:
            continue
        if getattr(getattr(a, "dtype", None), "kind", None) in ("U", "O") and not _all_text(
                _as_array(a)):
            raise ValueError(
                f"`{name}` holds a text array with a value that is neither text nor bytes "
                "(pandas stores a missing text as NaN) or that cannot be encoded as UTF-8. "
                "Replace such values (e.g. missing text with '') before training: read only "
                "when a sample drew that row, it would stop training exactly when that "
                "example was sampled.")


def _all_text(a) -> bool:
    """Whether every entry of a str/object array is bytes or UTF-8-encodable text (checked
    once, up front; session 22 audit)."""
    for v in np.ravel(a):
        if isinstance(v, bytes):
            continue
        if not isinstance(v, str):
            return False
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _lists_to_tuples(structure):
    if isinstance(structure, list):
        return tuple(_lists_to_tuples(s) for s in structure)
    if isinstance(structure, tuple) and not hasattr(structure, "_fields"):
        return tuple(_lists_to_tuples(s) for s in structure)
    if isinstance(structure, dict):
        return {k: _lists_to_tuples(v) for k, v in structure.items()}
    return structure


def _as_array(a):
    if isinstance(a, np.ndarray):  # np.memmap included: kept, not read into memory
        return a
    if hasattr(a, "to_numpy"):  # pandas
        return a.to_numpy()
    return np.asarray(a)


def _take_rows(arrays, index):
    """``np.take(a, index, axis=0)`` of every array, in a ``tf.numpy_function``: the graph
    holds a reference to the arrays, not their values (no 2 GB GraphDef limit, no copy)."""
    flat = tf.nest.flatten(arrays)
    leaves = [a for a in flat if a is not None]
    strings = [a.dtype.kind in "USO" for a in leaves]
    dtypes = [tf.string if s else tf.as_dtype(a.dtype) for a, s in zip(leaves, strings)]

    def take(i):
        rows = [np.asarray(np.take(a, i, axis=0)) for a in leaves]
        return [_utf8(r) if s else r for r, s in zip(rows, strings)]

    rows = tf.numpy_function(take, [index], dtypes, name="tf_dp_poisson_rows")
    rows = iter(rows)
    out = []
    for a in flat:
        if a is None:
            out.append(None)
            continue
        t = next(rows)
        t.set_shape((None,) + a.shape[1:])
        out.append(t)
    return tf.nest.pack_sequence_as(arrays, out)


def _utf8(rows):
    """Text rows as UTF-8 bytes (as ``tf.constant`` encodes them; numpy_function would use
    ASCII)."""
    encode = np.vectorize(lambda v: v.encode("utf-8") if isinstance(v, str) else v,
                          otypes=[object])
    return encode(rows) if rows.size else rows.astype(object)


class _DatasetSource:
    """A ``tf.data.Dataset`` of single examples: a sample is one pass keeping each element
    with probability q."""

    def __init__(self, dataset, n):
        if _yields_batches(dataset):
            raise ValueError(
                "The dataset `x` yields batches (its last transformations include batch()): "
                "PoissonSampler samples each element as one example, so a whole batch would "
                "be kept or left out together and epsilon would protect batches, not "
                "examples. Pass the dataset of single examples (before batch(), or after "
                "unbatch()).")
        for spec in tf.nest.flatten(dataset.element_spec):
            # A fully defined shape too: with an unknown dimension one example of another
            # length would fail every sample that drew it (session 22 audit).
            if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
                raise ValueError(f"The elements of the dataset `x` must be dense tensors of a "
                                 f"fixed shape (one example each), got {spec}.")
        self.data, self.size = dataset, n
        self._chunk = _chunk_size(dataset.element_spec)
        self._head = None

    def head(self):
        if self._head is None:
            batch = next(iter(self.data.take(_HEAD_ROWS).batch(_HEAD_ROWS)))
            self._head = tf.nest.map_structure(lambda t: None if t is None else t.numpy(),
                                               _split(batch))
        return self._head

    def samples(self, steps, q_of, stream, with_step=False):
        """``(x, y, sample_weight)`` of one Poisson sample per element of ``steps``: one pass
        over the source each, at rate ``q_of(step)`` (and the step appended with
        ``with_step``)."""
        spec = self.data.element_spec
        if with_step:
            passes = steps.flat_map(lambda step: tf.data.Dataset.zip((
                _one_pass(self.data, self.size, q_of(step), stream.next_seed(), self._chunk),
                tf.data.Dataset.from_tensors(step))))
            return passes.map(lambda e, step: (*_split(e if isinstance(spec, tuple) else e),
                                               step))
        passes = steps.flat_map(lambda step: _one_pass(self.data, self.size, q_of(step),
                                                       stream.next_seed(), self._chunk))
        # map() unpacks a tuple element into arguments: pack it back before splitting.
        return passes.map(lambda *e: _split(e if isinstance(spec, tuple) else e[0]))


def _source_size(dataset, dataset_size):
    """N of a dataset source: its cardinality, or ``dataset_size`` when TF does not know it."""
    if dataset_size is not None:
        dataset_size = _validation.positive_int(dataset_size, "dataset_size")
    card = int(dataset.cardinality())
    if card == tf.data.INFINITE_CARDINALITY:
        raise ValueError("The dataset `x` is infinite (repeat() without a count?): Poisson "
                         "sampling draws from a data set of N examples; pass the dataset "
                         "before repeat().")
    if card == 0:
        raise ValueError("The dataset `x` has no examples.")
    if card > 0:
        if dataset_size is not None and dataset_size != card:
            raise ValueError(f"`dataset_size` must be the dataset's cardinality ({card}), got "
                             f"{dataset_size}.")
        return card
    if dataset_size is None:
        raise ValueError(
            "TensorFlow does not know how many examples the dataset `x` has (after filter(), "
            "from_generator(), files, ...): pass `dataset_size=N`, the exact number. q * N is "
            "the denominator of the private mean, so it must be exact; every pass over the "
            "dataset checks it.")
    return dataset_size


def _yields_batches(dataset):
    """True if a batch() is among the last single-input transformations of ``dataset`` (not
    undone by unbatch(); flat_map and interleave make new elements, so the walk stops)."""
    node = dataset
    while node is not None:
        name = type(node).__name__
        if name in _BATCHING:
            return True
        if any(word in name for word in ("Unbatch", "FlatMap", "Interleave")):
            return False
        try:
            inputs = node._inputs()  # tf.data's own lineage
        except Exception:  # noqa: BLE001 (a source dataset)
            return False
        node = inputs[0] if len(inputs) == 1 else None
    return False


def _split(element):
    """``(x, y, sample_weight)`` of an element, Keras' convention: a tuple of 2 or 3 is
    ``(x, y[, sample_weight])``, anything else is ``x`` alone."""
    if isinstance(element, tuple) and 1 <= len(element) <= 3:
        return tuple(element) + (None,) * (3 - len(element))
    return element, None, None


def _chunk_size(spec) -> int:
    nbytes = 0
    for s in tf.nest.flatten(spec):
        values = 1 if s.shape.rank is None else math.prod(d or 1 for d in s.shape)
        nbytes += values * (32 if s.dtype == tf.string else s.dtype.size)
    return int(min(_MAX_CHUNK, max(1, _CHUNK_BYTES // max(1, nbytes))))


#: TensorFlow's float64 uniforms are k / 2^52, k uniform on {0, ..., 2^52 - 1}
#: (``tests/data/exact_rate_test.py`` pins it)
_UNIFORM_BITS = 52


def exact_rate(q: float) -> float:
    """The sampling probability actually used for a requested ``q``: ``ceil(q 2^52) / 2^52``,
    the smallest multiple of 2^-52 at or above q (exact in float64; at most 2^-52 above q).

    An example is kept iff ``u < q`` for a float64 uniform u = k / 2^52: with q a multiple
    m / 2^52 of the grid that happens for exactly m of the 2^52 values of k, so the
    inclusion probability IS q, and the accountant, which reads this q, accounts exactly the
    sampling that happens. (Before, u and q were float32: u = k / 2^23, and the inclusion
    probability ceil(fl32(q) 2^23) / 2^23 exceeded the accounted q by up to 2^-23, e.g. by
    1.7e-5 of it at q = 256 / 60000: a slightly optimistic epsilon.)
    """
    scale = 2.0 ** _UNIFORM_BITS
    return min(1.0, math.ceil(float(q) * scale) / scale)


def _one_pass(source, n, q, seed, chunk):
    """A dataset of one element: the elements of one pass over ``source`` that are kept,
    batched (possibly none of them).

    Element i is kept iff ``u_i < q``, u_i the (i mod chunk)-th of ``chunk`` stateless
    uniforms drawn from ``randomness.fold_seed(seed, i // chunk + 1)``: independent
    Bernoulli(q) given the secret seed, whose 128 bits every chunk's seed keeps. The pass must hold exactly ``n`` elements: more fails as soon as the
    (n+1)-th arrives, fewer at its end.
    """
    spec = source.element_spec
    if any(s.shape.rank is None for s in tf.nest.flatten(spec)):
        raise ValueError("The elements of the dataset `x` must have a known rank.")
    # No rows, for the end-of-pass marker and for a pass that keeps nothing.
    empty = tf.nest.map_structure(
        lambda s: tf.zeros([0] + [d or 0 for d in s.shape], s.dtype), spec)

    def keep(c, rows):
        k = tf.shape(tf.nest.flatten(rows)[0])[0]
        # (chunk c's seed keeps all 128 secret bits: randomness.fold_seed, tag c + 1 != 0)
        u = randomness.uniform(randomness.fold_seed(seed, tf.cast(c, tf.int64) + 1), [chunk])
        mask = u[:k] < tf.cast(q, tf.float64)
        kept = tf.nest.map_structure(lambda r: tf.boolean_mask(r, mask), rows)
        return tf.cast(k, tf.int64), kept, False

    def count(total, element):
        k, kept, end = element
        total += k
        checks = [
            tf.debugging.assert_less_equal(
                total, tf.constant(n, tf.int64),
                message=f"tf_dp: the dataset given to PoissonSampler yields more than "
                        f"`dataset_size` = {n} examples in one pass; q * N would be wrong."),
            tf.debugging.assert_equal(  # x = the examples of the pass, at its end
                tf.where(end, total, n), tf.constant(n, tf.int64),
                message=f"tf_dp: the dataset given to PoissonSampler yielded fewer than "
                        f"`dataset_size` = {n} examples in one pass; q * N would be wrong.")]
        with tf.control_dependencies(checks):
            return total, tf.nest.map_structure(tf.identity, kept)

    marker = tf.data.Dataset.from_tensors((tf.constant(0, tf.int64), empty, True))
    kept = (source.batch(chunk).enumerate().map(keep).concatenate(marker)
            .scan(tf.constant(0, tf.int64), count))
    # At most n rows are kept, so batch(n + 1) waits for the end of the pass (and its check).
    batch = kept.unbatch().batch(n + 1)
    return batch.concatenate(tf.data.Dataset.from_tensors(empty)).take(1)


def _finish(batch, pad_to, static, order=None):
    """``(x, y[, sample_weight])``; with ``pad_to``, weight-0 rows up to the next multiple of
    it (at least one ``pad_to``): a sample larger than ``pad_to`` is padded further, never
    truncated or refused. ``static``: the batch never exceeds ``pad_to`` (pad_to >= N).

    ``order``: a ``SecretStream``; with ``pad_to``, the padded batch's rows are then put in
    a uniformly random order drawn from its next seed (``_shuffled_rows``)."""
    x, y, sw = batch
    if sw is not None:
        sw = tf.cast(sw, tf.float32)
    if pad_to is None:
        return (x, y) if sw is None else (x, y, sw)
    m = tf.shape(tf.nest.flatten(x)[0])[0]
    size = tf.maximum(1, (m + pad_to - 1) // pad_to) * pad_to
    weight = tf.ones([m], tf.float32) if sw is None else sw

    def pad(a):
        if a is None:
            return None
        zeros = tf.zeros(tf.concat([[size - m], tf.shape(a)[1:]], 0), a.dtype)
        return tf.ensure_shape(tf.concat([a, zeros], axis=0),
                               [pad_to if static else None] + a.shape[1:].as_list())

    out = tf.nest.map_structure(pad, x), tf.nest.map_structure(pad, y), pad(weight)
    return out if order is None else _shuffled_rows(out, size, order.next_seed())


def _shuffled_rows(batch, size, seed):
    """``batch`` with its ``size`` rows in a uniformly random order: sorted by ``size``
    full-range int64 Philox words from the secret ``seed`` (all 128 bits kept,
    ``randomness.words``). Two words are equal with probability below size^2 / 2^65 per
    batch (~4e-15 at 400 rows); a tie keeps the two rows' order (stable sort), the only
    departure from a uniform permutation.

    Why (docs/privacy.md): with one batch shape, the rows of D + z can be laid out as those
    of D with z in a uniformly random padding slot, the same distribution as an independent
    shuffle of D + z's rows. In that coupling every example of D keeps its row, so any
    kernel whose result for a row depends on the row's values, its position and the
    batch's shape gives it the same gradient in both. In index order, z would shift every
    later example by one row."""
    keys = randomness.words(seed, tf.reshape(size, [1]), tf.int64)
    rows = tf.argsort(keys, stable=True)
    return tf.nest.map_structure(lambda a: None if a is None else tf.ensure_shape(
        tf.gather(a, rows), a.shape), batch)
