"""Keras models whose train step is private: DPModel, DPSequential and make_private."""

from __future__ import annotations

import json
import logging
import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _internals, _validation
from tf_dp.core import losses as losses_lib
from tf_dp.core import carriers, clipping, ghost, independence, jl, private_step
from tf_dp.core import loss_scale as loss_scale_lib
from tf_dp.keras import budget as budget_lib
from tf_dp.keras.budget import PrivacyBudget
from tf_dp.keras import steering
from tf_dp.keras.budget_journal import journals_for
from tf_dp.schedules import PiecewiseBatchSize
from tf_dp.keras.privacy_callback import PrivacyCallback
from tf_dp.optimizers import dp_optimizer as dp_optimizer_lib
from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin

_FIXED_BATCH_NOTE = (
    "tf_dp: training on fixed (shuffled) batches, accounted as if they were Poisson samples "
    "at q = batch / dataset size. That is outside the proven guarantee; pass arrays to fit() "
    "(Poisson sampling is then done for you) or a tf_dp.data.PoissonSampler for a guarantee "
    "that matches the accounting.")

_LOG = logging.getLogger("tf_dp")

_BUDGET_KEY = "tf_dp_privacy_budget"
#: the budget's node in a tf.train.Checkpoint of the model (its JSON record, no secret).
#: Not "tf_dp_...": tests/privacy/noise_secrecy_test.py takes that prefix in a checkpoint as
#: the mark of the optimizer's secret state (key, counter), which is never saved.
_CHECKPOINT_NODE = "dp_privacy_budget"


class DPTrainMixin:
    """The private train step, mixed into a Keras model class.

    ``compile`` requires a tf_dp DP optimizer. ``fit`` on arrays Poisson-samples each batch
    (each example independently with rate q = batch_size / N; the batch size is then an
    expected size) so that training matches the privacy accounting. ``train_step`` clips
    each example's gradient, and the optimizer adds noise once per logical step and records
    it; the model's accountant drains those records, so every applied step is accounted in
    any loop (``fit``, ``train_on_batch``, a custom loop over ``train_step``).

    The spent budget never goes down: it is saved with the model (config and weights files,
    and a ``tf.train.Checkpoint`` of the model) and restoring an older checkpoint into a model
    that has trained keeps the larger one. Private models over the same variables share one
    budget. ``model.optimizer`` is replaced by ``compile`` only (assignment is refused).
    """

    # ------------------------------------------------------------------ privacy budget

    @property
    def privacy_budget(self) -> PrivacyBudget:
        """The model's ``PrivacyBudget`` (tf_dp/keras/budget.py), up to date with the
        optimizer's applied steps."""
        budget = self._dp_budget_obj()
        budget.drain(_dp_optimizer_of(getattr(self, "optimizer", None)))
        return budget

    def _dp_budget_obj(self):
        budget = getattr(self, "_dp_budget", None)
        if budget is None:
            budget = self._dp_budget = PrivacyBudget()
        elif budget.merged_into is not None:
            # Another private model over some of the same variables took this budget in
            # (``_dp_claim_variables``): the budget they share now.
            budget = self._dp_budget = budget.current()
        return budget

    def _dp_drain(self):
        """Moves the steps the optimizer applied since the last call into the budget."""
        self._dp_budget_obj().drain(_dp_optimizer_of(getattr(self, "optimizer", None)))

    @property
    def privacy_delta(self) -> float:
        """The delta at which ``epsilon`` is reported (``make_private(model, delta=...)``)."""
        return self._dp_budget_obj().delta

    @privacy_delta.setter
    def privacy_delta(self, value):
        self._dp_budget_obj().delta = value

    @property
    def target_epsilon(self):
        """When set, ``fit`` stops before the step that would exceed this epsilon."""
        return self._dp_budget_obj().target_epsilon

    @target_epsilon.setter
    def target_epsilon(self, value):
        self._dp_budget_obj().target_epsilon = value

    @property
    def accountant(self):
        """The model's ``tf_dp.accounting.PrivacyAccountant`` (every private step so far)."""
        return self.privacy_budget.accountant

    @property
    def exact_clipping_accountant(self):
        """The steps of JL optimizers accounted as exact clipping, for comparison only."""
        return self.privacy_budget.exact_clipping_accountant

    def epsilon(self, delta: float = None, exact_clipping: bool = False) -> float:
        """Epsilon spent so far at ``delta`` (default: the model's ``privacy_delta``).

        With ``exact_clipping=True``: what the JL steps would have cost with exact norms.
        When the accountant cannot reach its stated accuracy (very small JL ``r``), the
        returned value is its valid but looser upper bound, with a warning.
        """
        return self.privacy_budget.epsilon(delta, exact_clipping)

    @property
    def privacy_caveats(self):
        """What, in this model's history, is outside the proven guarantee (list of str)."""
        return sorted(self._dp_budget_obj().caveats)

    def _dp_caveat(self, text):
        self._dp_budget_obj().caveat(text)

    def privacy_report(self) -> dict:
        """The spent budget and what it covers: epsilon at the model's delta, the steps
        accounted per mechanism, and the caveats (see docs/privacy.md).

        ``guarantee_holds`` is False when a caveat voids the proof for the released model: a
        seeded optimizer or sampler (anyone with the seed removes the noise), fixed batches
        (accounted as if Poisson-sampled), preprocessing adapted on data (its statistics
        are in the model, outside epsilon), a callback that steered training with a
        metric of the training data (``EarlyStopping(monitor='loss')``: its decision is
        outside epsilon), a model the checks for mixing examples could not compare
        (``UNCHECKED``), or Python code run inside the private step by ``tf.py_function``
        (``OPAQUE_PYTHON``). Sampling declared by the user
        (``sampling_probability=``) is a caveat the report lists but cannot check.
        """
        return self.privacy_budget.report(self._dp_clipping_description())

    def privacy_statement(self) -> str:
        """``privacy_report()`` as readable text (unit of privacy, sampling, steps per
        mechanism, epsilon and RDP's for comparison, caveats, what is never covered)."""
        return self.privacy_budget.statement(self._dp_clipping_description())

    def _dp_clipping_description(self):
        opt = _dp_optimizer_of(getattr(self, "optimizer", None))
        return None if opt is None else opt.clipping_description()

    def get_config(self):
        config = super().get_config()
        config["tf_dp"] = self.privacy_budget.get_config()
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        extra = config.pop("tf_dp", None)
        model = super().from_config(config, custom_objects=custom_objects)
        if extra:
            # Another branch of the saved run: a new lineage that remembers the saved one.
            model._dp_budget = PrivacyBudget.from_config(extra).forked()
        return model

    def save_own_variables(self, store):
        """Saves the weights and, beside them, the spent budget (so ``save_weights`` /
        ``BackupAndRestore`` / checkpoints carry it)."""
        super().save_own_variables(store)
        blob = json.dumps(self.privacy_budget.get_config()).encode()
        store[_BUDGET_KEY] = np.frombuffer(blob, dtype=np.uint8)

    def load_own_variables(self, store):
        """Loads the weights; the spent budget becomes the larger of the model's own and the
        file's (never smaller): see ``PrivacyBudget.merge``."""
        if _BUDGET_KEY in store:
            saved = json.loads(bytes(np.asarray(store[_BUDGET_KEY], dtype=np.uint8)).decode())
            self.privacy_budget.merge(saved)
            store = _StoreWithout(store, _BUDGET_KEY)
        super().load_own_variables(store)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # tf.train.Checkpoint / CheckpointManager of the model save the spent budget beside
        # the weights, and restoring merges it (never lowers it): see _BudgetCheckpoint.
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "checkpoint":
            children = dict(children)
            children[_CHECKPOINT_NODE] = self._dp_budget_checkpoint()
        return children

    def _lookup_dependency(self, name, cached_dependencies=None):
        if name == _CHECKPOINT_NODE:
            return self._dp_budget_checkpoint()
        return super()._lookup_dependency(name, cached_dependencies)

    def _dp_budget_checkpoint(self):
        node = self.__dict__.get("_dp_budget_node")
        if node is None:
            node = _BudgetCheckpoint(self)
            # Not through Keras' __setattr__: it would track the node a second time.
            object.__setattr__(self, "_dp_budget_node", node)
        return node

    def __setattr__(self, name, value):
        if (name == "optimizer" and not self.__dict__.get("_dp_compiling", False)
                and value is not self.__dict__.get("optimizer")):
            raise AttributeError(
                "tf_dp: assigning `model.optimizer` is refused on a private model: call "
                "model.compile(optimizer=..., loss=...) instead. compile() accounts the steps "
                "the current optimizer applied before replacing it, checks that the new one "
                "is a tf_dp DP optimizer and records its caveats (e.g. a seed); an assignment "
                "would do none of this (the old optimizer's unaccounted steps would be lost).")
        super().__setattr__(name, value)

    def _dp_claim_variables(self):
        """Binds this model's variables (trainable or not) to its budget. Variables another private
        model already trains under its own budget (``make_private`` called twice on one
        model, two private models sharing layers) carry that budget's steps too: the two
        budgets become one (``PrivacyBudget.absorb``) that both models report, with a
        warning, so that no model reports only its own share of the steps its weights had."""
        mine = self._dp_budget_obj()
        # Every weight the model releases, frozen ones too: a layer another private model
        # trained and this one reuses frozen carries that model's steps (session 21 audit:
        # its budget was left out, eps 4.21 reported for weights that had spent 6.45).
        variables = list(self.weights)
        with _CLAIM_LOCK:
            others = []
            for v in variables:
                entry = _VARIABLE_BUDGETS.get(id(v))
                if entry is None or entry[0]() is not v:
                    continue
                other = entry[1].current()
                if other is not mine and not any(other is o for o in others):
                    others.append(other)
            if others:
                shared = others[0]
                before = [o.accountant.steps for o in others] + [mine.accountant.steps]
                for budget in others[1:] + [mine]:
                    shared.absorb(budget, warning=_SHARED_COMPOSED)
                self._dp_budget = shared
                mine = shared
                warnings.warn(
                    f"tf_dp: some weights of {self.name!r} are also trained by another "
                    "private model (make_private called twice on one model, or two private "
                    "models sharing layers, trainable or frozen): the weights carry the steps "
                    "of both, so "
                    "the models now share one privacy budget that counts all of them "
                    f"({' + '.join(str(n) for n in before)} steps so far; delta "
                    f"{shared.delta:g}, target epsilon {shared.target_epsilon}).",
                    UserWarning, stacklevel=3)
            for v in variables:
                entry = _VARIABLE_BUDGETS.get(id(v))
                if entry is None or entry[0]() is not v:
                    _VARIABLE_BUDGETS[id(v)] = (weakref.ref(v, _forget_variable(id(v))), mine)
                elif entry[1].current() is mine and entry[1] is not mine:
                    _VARIABLE_BUDGETS[id(v)] = (entry[0], mine)
        return mine

    # ------------------------------------------------------------------ compile / fit

    def compile(self, optimizer=None, loss=None, loss_weights=None, **kwargs):
        if optimizer is None or _dp_optimizer_of(optimizer) is None:
            raise TypeError(
                "A private model needs a tf_dp differentially private optimizer "
                "(tf_dp.DPSGD, tf_dp.DPAdam, tf_dp.DPAdamW, ...), got `optimizer`="
                f"{optimizer!r}. A plain optimizer would train without privacy.")
        # Steps of a previous optimizer are accounted before it is replaced; the budget keeps
        # draining it afterwards (a function traced before this compile still applies steps
        # through it).
        self._dp_drain()
        _refuse_another_models_optimizer(self, _dp_optimizer_of(optimizer))
        self._dp_budget_obj().track(_dp_optimizer_of(optimizer))
        # XLA cannot compile every fallback (vectorized_map / map_fn); keep it opt-in.
        kwargs.setdefault("jit_compile", False)
        # The private step scales per-example losses itself, by a fixed scale (below):
        # Keras' LossScaleOptimizer (dynamic, data-dependent skips) is not wanted.
        kwargs.setdefault("auto_scale_loss", False)
        object.__setattr__(self, "_dp_compiling", True)
        try:
            super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                            **kwargs)
        finally:
            object.__setattr__(self, "_dp_compiling", False)
        if self.built:
            self._dp_claim_variables()
        self._dp_loss = losses_lib.build_per_example_loss(loss, loss_weights,
                                                          _output_names(self))
        # mixed_float16: a fixed, data-independent loss scale (Keras' dynamic scaling skips
        # steps when a gradient overflows, a decision that depends on the private data).
        # If a LossScaleOptimizer wraps the DP optimizer anyway (auto_scale_loss=True or a
        # wrapped optimizer given), its dynamic scale is never used: the private step
        # applies through the DP optimizer itself.
        self._dp_loss_scale = loss_scale_lib.fixed_loss_scale(self)
        if _dp_optimizer_of(optimizer).seeded:
            self._dp_caveat(_SEEDED_CAVEAT)
        opt = _dp_optimizer_of(optimizer)
        trainable = carriers.carrier_for(self).trainable if self.built else []
        if self.built and not opt.built and trainable:
            # Built here, outside any trace: slot variables created during the first trace
            # of a tf.function (even under init_scope) make it trace the private step a
            # second time (the first step took 1.9x non-private's on the CNN, 1.1x built
            # here). An unbuilt model's optimizer is built by fit or by the step itself.
            # (A model "built" without variables, a subclassed model's build(shape) with no
            # build method of its own, builds them in its first call: the optimizer then.)
            opt.build(trainable)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, sample_weight=None,
            steps_per_epoch=None, poisson_sampling: bool = True, dataset_size: int = None,
            sampling_probability: float = None, max_physical_batch_size: int = None,
            gradient_snr: str = None, fixed_batch_shape: bool = False, **kwargs):
        """Keras ``fit`` with Poisson sampling for array inputs (see the class docstring).

        Extra arguments:
          poisson_sampling: for array inputs, sample each batch by Poisson sampling with rate
            q = batch_size / N (default True). False trains on shuffled fixed batches; the
            training output then notes that the accounting assumes Poisson sampling.
          dataset_size: N, required for a ``tf.data.Dataset`` (or other iterable) that does
            not come from a ``tf_dp.data.PoissonSampler``: q is never guessed from a
            dataset's cardinality. Each element is then one logical batch; q = its size / N.
          sampling_probability: with ``dataset_size``, declares that the dataset's batches
            are Poisson samples at this rate (the expected batch is then q * N). tf_dp cannot
            check this; the privacy report says so.
          max_physical_batch_size: at most this many examples go through the model at once
            (Opacus' BatchMemoryManager): each logical batch, whatever its realised Poisson
            size, is split into as many micro-batches as needed; noise is still added once
            per logical step. Every part runs padded to this size rounded up to a multiple
            of 16 rows (weight 0; ``private_step.ROW_MULTIPLE``). None (default):
            ``gradient_accumulation_steps`` parts.
          gradient_snr: None (default), "private" or "exact": logs ``gradient_snr``, each
            logical step's ``||clipped sum|| / ||noise||`` (Anil et al. 2021; in History the
            epoch's last step). "private" estimates it from the noised update alone
            (post-processing, inside the guarantee); "exact" reads the un-noised sum, a
            statistic of the data outside the guarantee (for public or proxy data). See
            ``tf_dp.optimizers.dp_optimizer.gradient_snr_of``.
          fixed_batch_shape: True pads fit's own Poisson batches (array inputs) to one
            size, which a batch exceeds with probability below 1e-12 per step
            (``safe_pad_to(N, q, tail=1e-12)``; padding rows have weight 0): every step
            then runs its kernels at a shape that does not depend on the data, so no
            kernel that rounds an example's gradient differently for different batch
            sizes or by a row's position can let one example move the others' gradients
            (the rows are in a secret random order; docs/privacy.md). Costs the padding's
            rows, about 6 standard deviations of the batch size. Under
            ``jit_compile=True`` fit pads so anyway. With ``max_physical_batch_size`` the
            padded batch is run in parts of that size.
        """
        from tf_dp.data.poisson import PoissonSampler, check_text, sampler_of

        _refuse_nested(self, "fit")
        if max_physical_batch_size is not None:
            max_physical_batch_size = _validation.positive_int(max_physical_batch_size,
                                                               "max_physical_batch_size")
        if getattr(self, "_dp_max_rows", None) != max_physical_batch_size:
            self.train_function = None  # baked into the traced step: retrace on change
        self._dp_max_rows = max_physical_batch_size
        if not isinstance(fixed_batch_shape, (bool, np.bool_)):
            raise TypeError(f"`fixed_batch_shape` must be True or False, got "
                            f"{fixed_batch_shape!r}.")
        if gradient_snr not in (None, "private", "exact"):
            raise ValueError(f"`gradient_snr` must be None, 'private' or 'exact', got "
                             f"{gradient_snr!r}.")
        if getattr(self, "_dp_gradient_snr", None) != gradient_snr:
            self.train_function = None  # baked into the traced step: retrace on change
        self._dp_gradient_snr = gradient_snr
        if gradient_snr == "exact":
            self._dp_caveat(_EXACT_SNR_CAVEAT)
            warnings.warn(_EXACT_SNR_CAVEAT, UserWarning, stacklevel=2)

        opt = _dp_optimizer_of(getattr(self, "optimizer", None))
        if opt is None:
            raise TypeError("Call compile() with a tf_dp DP optimizer before fit().")
        if kwargs.get("class_weight") is not None and not _is_array_like(x):
            # Keras weighs a dataset's batches by gathering from a table as long as the
            # largest class in the dict: a label beyond it stops fit at the step that sampled
            # it, which tells that example was in that batch (session 23 audit: a
            # PoissonSampler stopped after 6 of 60 steps). On arrays the weights are formed
            # up front, absent classes weighing 1.
            raise ValueError(
                "`class_weight` is supported for array inputs only (x, y as arrays); for a "
                f"{type(x).__name__} pass per-example weights instead: "
                "PoissonSampler(x, y, sample_weight=...) or a dataset of (x, y, "
                "sample_weight).")
        _note_class_weight(self, kwargs.get("class_weight"))
        self._dp_drain()
        _check_declared_size(x, dataset_size, sampling_probability, poisson_sampling)
        if _is_array_like(x):
            for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
                check_text(name, part)
        callbacks = steering.flatten(callbacks)
        for caveat in steering.steering_caveats(
                callbacks, validation_private=bool(validation_split) and validation_data is None,
                gradient_snr=gradient_snr):
            # A warning whatever `verbose`: the decision is outside epsilon.
            self._dp_caveat(caveat)
            warnings.warn("tf_dp: " + caveat, UserWarning, stacklevel=2)
        _note_analysis_callbacks(self, callbacks)
        # Before anything is computed from the spent budget: the steps a killed process
        # applied after its last backup are in its budget journal (write-ahead record).
        journals = journals_for(callbacks)
        for journal in journals:
            journal.recover(self)
        if opt.seeded:
            self._dp_caveat(_SEEDED_CAVEAT)
            warnings.warn(_SEEDED_CAVEAT, UserWarning, stacklevel=2)
        self._dp_check_model(x, y, sample_weight)
        if self.built:
            # (Again: the check may have built the model.) Before the plan below reads the
            # spent budget, which a model sharing variables with another one shares.
            self._dp_claim_variables()
        k = opt.accumulation_steps
        self._dp_without_xla_where_it_aborts(k)
        schedule = batch_size if isinstance(batch_size, PiecewiseBatchSize) else None
        if schedule is not None:
            batch_size = None
            if not _is_array_like(x) or not poisson_sampling:
                raise ValueError("A `batch_size` schedule needs array inputs with "
                                 "poisson_sampling=True (or a PoissonSampler built with "
                                 "expected_batch_size=schedule).")
        if fixed_batch_shape:
            _check_fixed_batch_shape_input(x, poisson_sampling, schedule)
        workers = _multi_worker_input_context(self)
        if workers is not None:
            if fixed_batch_shape:
                raise ValueError("`fixed_batch_shape=True` is not supported under "
                                 "MultiWorkerMirroredStrategy: each worker samples its own "
                                 "shard, whose batches fit does not pad.")
            _check_multi_worker_input(workers, x, poisson_sampling, schedule, validation_split,
                                      validation_data, dataset_size, sampling_probability)
        sampler = x if isinstance(x, PoissonSampler) else None
        data = None
        if sampler is None and isinstance(x, tf.data.Dataset):
            sampler = sampler_of(x)
            data = x if sampler is not None else None
        if sampler is None and poisson_sampling and _is_array_like(x):
            if validation_split and validation_data is None:
                (x, y, sample_weight), validation_data = _split_validation(
                    x, y, sample_weight, validation_split)
                validation_split = 0.0
            if sample_weight is None and kwargs.get("class_weight") is not None:
                # The class weights become sample weights here, for every Poisson fit on
                # arrays: padded batches carry sample weights (0 on padding rows), which
                # Keras refuses next to class_weight, and Keras' own class weighting stops
                # fit when a batch holds a label absent from the dict (a stop that tells that
                # example was sampled, session 22 audit); absent classes weigh 1 here.
                sample_weight = _class_weights(y, kwargs.pop("class_weight"))
            # Keras semantics: `batch_size` is one micro-batch; a logical batch is k of them.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a seeded optimizer already warned
                if workers is None:
                    expected_size = (schedule.scaled(k) if schedule is not None
                                     else (batch_size or 32) * k)
                    pad_to = _one_shape_pad_to(self, schedule, x, expected_size,
                                               fixed_batch_shape)
                    sampler = PoissonSampler(x, y, sample_weight=sample_weight,
                                             expected_batch_size=expected_size,
                                             pad_to=pad_to, seed=opt._next_sampler_seed())
                else:
                    sampler = _worker_shard_sampler(self.distribute_strategy, workers, x, y,
                                                    sample_weight,
                                                    schedule.scaled(k) if schedule is not None
                                                    else (batch_size or 32) * k,
                                                    opt._next_sampler_seed())
        if sampler is not None:
            if sampler.seed is not None:
                self._dp_caveat(_SEEDED_CAVEAT)
            q, expected = sampler.sampling_probability, sampler.expected_batch_size
            if sampler.schedule is not None:
                q, expected = sampler.phase_probabilities, sampler.phase_batch_sizes
            if workers is not None:
                # Each worker samples its own shard at q: the union is one Poisson sample of
                # the whole data set, whose expected size q * N divides the all-reduced sum.
                n = len(tf.nest.flatten(x)[0])
                expected = tuple(p * n for p in q) if isinstance(q, tuple) else q * n
            schedule_start = None
            if data is None and sampler.schedule is not None:
                # The schedule follows the optimizer's step count, as Keras learning-rate
                # schedules do: a second fit continues it, and a run restored by
                # BackupAndRestore resumes at its restored step (read when the first batch
                # is drawn, after the restore; see _ScheduleStart), not at phase 0.
                with tf.init_scope():
                    schedule_start = tf.Variable(
                        int(keras.ops.convert_to_numpy(opt.iterations)), dtype=tf.int64,
                        trainable=False, name="tf_dp_schedule_start")
            data = (sampler.dataset(first_step=schedule_start if schedule_start is not None
                                    else 0) if data is None else data)
            fit_args = dict(x=data, shuffle=False,
                            steps_per_epoch=steps_per_epoch or sampler.steps_per_epoch)
            poisson = True
        else:
            if _is_array_like(x):
                # Keras semantics: `batch_size` (default 32) is one micro-batch; each Keras
                # batch is one logical batch of k of them.
                batch_size = (batch_size or 32) * k
            q, expected, poisson = _fixed_batch_sampling(
                x, batch_size, validation_split, dataset_size, sampling_probability)
            if poisson:
                self._dp_caveat("DECLARED_SAMPLING: fit() was told the batches are Poisson "
                                f"samples at q = {q:g} (sampling_probability=); tf_dp did not "
                                "draw them and cannot check it.")
            else:
                self._dp_caveat("FIXED_BATCHES: " + _FIXED_BATCH_NOTE[len("tf_dp: "):])
                # A warning whatever `verbose`: the proven guarantee does not cover this run.
                warnings.warn(_FIXED_BATCH_NOTE, UserWarning, stacklevel=2)
            fit_args = dict(x=x, y=y, batch_size=batch_size, validation_split=validation_split,
                            shuffle=shuffle if _is_array_like(x) else False,
                            sample_weight=sample_weight,
                            steps_per_epoch=steps_per_epoch)
        scheduled = isinstance(q, tuple)
        if scheduled:
            # Costed from the step the schedule starts at (fit's own sampler continues it at
            # the optimizer's step count); a dataset the user made from a sampler starts
            # where they chose, unknown here: every step at the costliest phase's q.
            start = (None if schedule_start is None
                     else int(keras.ops.convert_to_numpy(opt.iterations)))
            budget = self.privacy_budget.remaining_steps(
                [opt.mechanism(p) for p in q], boundaries=sampler.schedule.boundaries,
                start=start)
        else:
            budget = self._dp_remaining_steps(opt.mechanism(q))
        if budget == 0:
            # Always a warning, whatever `verbose`: nothing trains and fit returns an empty
            # History, which must not pass unnoticed.
            first = opt.mechanism(q[0] if scheduled else q)
            warnings.warn(self.privacy_budget.no_budget_message(first), UserWarning,
                          stacklevel=2)
            return _empty_history(self)
        planned = None
        if fit_args.get("steps_per_epoch") and getattr(self, "steps_per_execution", 1) > 1:
            # Keras rounds every epoch up to a multiple of steps_per_execution on an endless
            # input (a Poisson sampler's, a repeated dataset): 3 epochs of 8 steps ran 27
            # steps at steps_per_execution=3 and 300 at 100, spending more than planned. The
            # stream ends after the steps asked for, and training stops there (PrivacyCallback:
            # Keras would otherwise start the next epoch on a fresh iterator); the epochs then
            # split the steps differently.
            planned = (epochs - int(kwargs.get("initial_epoch", 0) or 0)) * int(
                fit_args["steps_per_epoch"])
        limit = planned if budget is None else budget if planned is None else min(budget, planned)
        limit_var = None
        if limit is not None and scheduled and budget is not None and schedule_start is not None:
            # BackupAndRestore may move the schedule's start when training begins (after this
            # point): _ScheduleStart then costs the steps again and may lower the limit.
            with tf.init_scope():
                limit_var = tf.Variable(limit, dtype=tf.int64, trainable=False,
                                        name="tf_dp_step_limit")
        if limit is not None:
            # Never more logical steps than the budget allows, whatever steps_per_execution:
            # the data stream itself ends there.
            if fit_args.get("validation_split") and validation_data is None:
                (fit_args["x"], fit_args["y"], fit_args["sample_weight"]), validation_data = (
                    _split_validation(fit_args["x"], fit_args["y"], fit_args["sample_weight"],
                                      fit_args["validation_split"]))
            fit_args["x"] = _limit_steps(fit_args, limit if limit_var is None else limit_var)
            if not isinstance(fit_args["x"], tf.data.Dataset):
                raise ValueError("`target_epsilon` needs array, PoissonSampler or tf.data input.")
            for key in ("y", "sample_weight", "batch_size", "validation_split"):
                fit_args.pop(key, None)
            fit_args["shuffle"] = False  # a dataset now (shuffled before, if it was arrays)
        if workers is not None and isinstance(fit_args["x"], tf.data.Dataset):
            # Each worker's own sample of a step goes to its own replicas only (Keras would
            # split every worker's batch over all replicas of the cluster, i.e. over two
            # steps). With L replicas on a worker, the sample is split into L parts, one per
            # local replica (rows j, j + L, ...): the worker's input pipeline hands L
            # consecutive elements to its L replicas for one step.
            local = _split_over_local_replicas(fit_args["x"], _local_replicas(workers),
                                               with_phase=scheduled)
            fit_args["x"] = self.distribute_strategy.distribute_datasets_from_function(
                lambda context: local)
        elif scheduled and (self._distribute_strategy is not None
                            or tf.distribute.has_strategy()):
            # tf.distribute splits every component of an element along its first axis over
            # the replicas: the phase index goes as a [1] vector, which exactly one replica
            # receives; the step sums it over replicas (_dp_train_step).
            fit_args["x"] = fit_args["x"].map(lambda batch, phase: (batch, tf.reshape(phase, [1])))
        if workers is not None and validation_data is not None:
            validation_data = _on_every_worker(
                self.distribute_strategy, validation_data,
                kwargs.pop("validation_batch_size", None) or batch_size or 32)
        self._dp_set_sampling(expected, q, poisson=poisson,
                              fixed_shape=_fixed_batch_shape(sampler))
        privacy = PrivacyCallback(max_steps=budget, verbose=verbose, planned_steps=planned)
        in_flight = (max((opt.mechanism(p) for p in q), key=lambda m: m[1]) if scheduled
                     else opt.mechanism(q))
        for journal in journals:
            journal.arm(in_flight)
        # The journals last: their first write follows BackupAndRestore's restore; so does
        # the schedule's start.
        callbacks = ([privacy] + [c for c in callbacks if c not in journals]
                     + [j for j in journals])
        if sampler is not None and schedule_start is not None:
            retarget = None
            if limit_var is not None:
                mechanisms = [opt.mechanism(p) for p in q]

                def retarget(start):
                    new = self.privacy_budget.remaining_steps(
                        mechanisms, boundaries=sampler.schedule.boundaries, start=start)
                    if new < int(limit_var.numpy()):
                        limit_var.assign(new)
                        privacy.max_steps = new
            callbacks.append(_ScheduleStart(schedule_start, opt, retarget))
        # Last: nothing runs between its on_train_batch_begin and Keras' own call of the train
        # function, the one call that takes fit's sampling (make_train_function).
        callbacks.append(_ArmDeclaredStep())
        object.__setattr__(self, "_dp_fit_mechanisms",
                           [opt.mechanism(p) for p in (q if scheduled else [q])])
        object.__setattr__(self, "_dp_unplanned_steps", False)
        object.__setattr__(self, "_dp_fit_allowance", None)
        try:
            with _declared_sampling(self):
                return super().fit(epochs=epochs, verbose=verbose, callbacks=callbacks,
                                   validation_data=validation_data, **fit_args, **kwargs)
        finally:
            object.__setattr__(self, "_dp_fit_mechanisms", None)
            self._dp_drain()
            for journal in journals:
                journal.settle()

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """One private step on this batch, accounted with q = 1: tf_dp did not sample it, so
        no amplification by sampling is claimed (the batch's size is treated as public)."""
        _refuse_nested(self, "train_on_batch")
        opt = _dp_optimizer_of(getattr(self, "optimizer", None))
        if opt is None:
            raise TypeError("Call compile() with a tf_dp DP optimizer before train_on_batch().")
        if self.built:
            self._dp_claim_variables()
        self._dp_drain()
        if self._dp_remaining_steps(opt.mechanism(1.0)) == 0:
            raise RuntimeError(
                f"tf_dp: another step would exceed the target epsilon {self.target_epsilon:g} "
                f"at delta {self.privacy_delta:g}; not training.")
        self._dp_check_model(x, y, sample_weight)
        _note_class_weight(self, class_weight)
        self._dp_without_xla_where_it_aborts(opt.accumulation_steps)
        self._dp_set_sampling(None, 1.0, poisson=False)
        try:
            with _declared_sampling(self):
                _arm_declared_step(self)  # Keras' train_on_batch calls the function once
                return super().train_on_batch(x, y, sample_weight=sample_weight,
                                              class_weight=class_weight,
                                              return_dict=return_dict)
        finally:
            self._dp_drain()

    def _dp_without_xla_where_it_aborts(self, accumulation_steps):
        """``jit_compile=False`` (said once) for a step with a micro-batch loop: XLA cannot
        compile the loop over a Poisson batch's dynamic size and aborts the whole process
        (a CHECK failure in literal.cc, TF 2.21), which no exception handler catches."""
        looped = accumulation_steps > 1 or getattr(self, "_dp_max_rows", None) is not None
        if not (looped and self.jit_compile):
            return
        self.jit_compile = False
        self.train_function = None
        if not getattr(self, "_dp_xla_warned", False):
            self._dp_xla_warned = True
            warnings.warn(
                "tf_dp: jit_compile=True is not used for this model: XLA cannot compile the "
                "private step's micro-batch loop (gradient_accumulation_steps > 1 or "
                "max_physical_batch_size) and would abort the process; training runs "
                "without XLA.", UserWarning, stacklevel=3)

    def check_before_training(self, x, y=None, sample_weight=None):
        """Runs the checks ``fit`` runs before the first private step on a real batch
        (``x``, ``y``: a few examples or more): layers that mix examples are refused, and,
        where norms come from layer formulas, layers whose rows are not the batch's
        examples in order (docs/privacy.md). Needed once before a private step traced by a
        custom loop (``tf.function`` over ``train_step``), and after changing which layers
        are trainable; ``fit`` and ``train_on_batch`` run it themselves. Compile first."""
        if getattr(self, "_dp_loss", None) is None:
            raise ValueError("Compile the model (with its loss) before check_before_training.")
        self._dp_check_model(x, y, sample_weight)

    def _dp_check_model(self, x, y, sample_weight):
        """Before training: refuses layers that mix examples (a generic check on rows of the
        real input, once per architecture) and notes preprocessing adapted on data."""
        adapted = independence.warn_adapted_layers(self, stacklevel=4)
        if adapted:
            self._dp_caveat("ADAPTED_PREPROCESSING: " + independence.adapted_layers_warning(
                adapted)[len("tf_dp: "):])
        independence.check_before_private_training(
            self, x, y, sample_weight, self._dp_loss,
            variables=carriers.carrier_for(self).privatized)
        if not independence.checks_passed(self):
            # The check could not compare (it warned why): the steps that follow train a
            # model nobody confirmed to be per-example.
            self._dp_caveat(_UNCHECKED_CAVEAT)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras peeks one distributed batch here and averages it over replicas, which fails
        # when a Poisson batch does not split evenly (replicas hold 3 and 2 examples). The
        # build needs only shapes and dtypes: the first replica's part serves.
        if iterator is not None and getattr(self, "_distribute_strategy", None) is not None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: (self.distribute_strategy.experimental_local_results(v)[0]
                               if isinstance(v, tf.distribute.DistributedValues) else v),
                    batch)
                break
            iterator = None
            sampling = getattr(self, "_dp_sampling", None)
            if (data_batch is not None and sampling is not None
                    and isinstance(sampling[1], tuple)):
                # A batch-size schedule's elements are (batch, phase): the build takes the
                # batch (the phase went in as the targets: review s24b, a shape error).
                data_batch = data_batch[0]
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _dp_remaining_steps(self, mechanism):
        """Steps of ``mechanism`` left within ``target_epsilon`` (None: no target)."""
        return self.privacy_budget.remaining_steps(mechanism)

    def _dp_set_sampling(self, expected_micro_batch_size, sampling_probability, poisson,
                         fixed_shape=False):
        """The sampling of the steps Keras' train function runs in this fit (or
        train_on_batch). It applies to those steps only: a step run any other way (a custom
        loop over ``train_step``, ``train_function`` called outside fit) is accounted at
        q = 1 (see ``make_train_function``). ``fixed_shape``: every batch has the same
        number of rows (but for a bad event of probability below ``_XLA_PAD_TAIL`` per
        step), which a step under XLA needs (``_XLA_SHAPES_CAVEAT``)."""
        state = (expected_micro_batch_size, sampling_probability, poisson, bool(fixed_shape))
        if getattr(self, "_dp_sampling", None) != state:
            # q and the expected batch size are baked into the traced step: retrace on change.
            self.train_function = None
        self._dp_sampling = state

    def make_train_function(self, force=False):
        """Keras' train function, whose steps take the sampling ``fit`` / ``train_on_batch``
        declared (``_dp_set_sampling``) when Keras' own loop calls it: the one call armed
        right before it (``_ArmDeclaredStep``, the last callback's ``on_train_batch_begin``;
        ``train_on_batch`` arms its one call). Any other call runs the step without that
        sampling, at q = 1: after fit returned, or from a callback during fit (session 21
        audit: a callback's own full-batch steps were accounted at fit's q, ε 2.8 reported
        for 24.5 spent)."""
        if self.train_function is not None and not force:
            return self.train_function
        declared = self._make_function(self._dp_declared_step)
        undeclared = []

        def train_function(iterator):
            armed = self.__dict__.get("_dp_armed", False)
            object.__setattr__(self, "_dp_armed", False)  # one call per arming, even if it raises
            # At every call: auto-clustering (or a mixed precision rewrite) turned on after
            # the step was traced reaches the traced step, which refused it only while
            # tracing (session 24 audit).
            private_step.check_no_xla_auto_clustering()
            private_step.check_exact_float_arithmetic()
            in_loop = self.__dict__.get("_dp_in_keras_loop", False)
            if armed and in_loop:
                _stop_if_the_target_is_reached(self)
                return declared(iterator)
            if in_loop:
                # A step of a callback's own during fit (q = 1): within the target, and fit
                # re-costs its own steps after it (session 21 audit: fit's step limit,
                # counted for its own steps, let callback steps take eps to 15.7 for a
                # target of 3.0).
                self._dp_drain()
                if self._dp_remaining_steps(_dp_optimizer_of(self.optimizer).mechanism(1.0)) == 0:
                    raise RuntimeError(
                        f"tf_dp: another step would exceed the target epsilon "
                        f"{self.target_epsilon:g} at delta {self.privacy_delta:g}; a callback's "
                        "own step during fit was not run.")
                object.__setattr__(self, "_dp_unplanned_steps", True)
            if not undeclared:
                undeclared.append(self._make_function(self.train_step))
            return undeclared[0](iterator)

        self.train_function = train_function
        return train_function

    def _dp_declared_step(self, data):
        """``train_step`` with the sampling declared by fit / train_on_batch (read when the
        step is traced, or at every call when eager)."""
        stack = _active_sampling_stack()
        stack.append((self, getattr(self, "_dp_sampling", None)))
        try:
            return self.train_step(data)
        finally:
            stack.pop()

    # ------------------------------------------------------------------ the private step

    def train_step(self, data):
        """One logical private step on ``data`` (a logical batch): see ``_dp_train_step``."""
        # Under a name scope of its own: a model named "_..." (a class "_MyModel") is not a
        # valid *root* name scope in a graph; Keras then fails and leaves its scope on its
        # global stack, prefixing every later variable path.
        with tf.name_scope("tf_dp_private_step"), private_step.own_train_step():
            logs = self._dp_train_step(data)
        if _internals.in_multi_worker_mode(self.distribute_strategy):
            # Keras reduces a multi-worker step's outputs with reduce("MEAN", axis=0), which
            # fails on scalars (keras-team/keras#20585): as [1] vectors they are averaged
            # over all replicas of the cluster into scalars.
            logs = {key: tf.reshape(value, [1]) for key, value in logs.items()}
        return logs

    def test_step(self, data):
        """Keras' evaluation step; under MultiWorkerMirroredStrategy its logs as [1] vectors
        (as ``train_step``'s: Keras' multi-worker reduction fails on scalars)."""
        logs = super().test_step(data)
        if _internals.in_multi_worker_mode(self.distribute_strategy):
            logs = {key: tf.reshape(value, [1]) for key, value in logs.items()}
        return logs

    @tf.autograph.experimental.do_not_convert  # no tensor-dependent Python control flow;
    # AutoGraph's conversion of the step was seconds of every process's first trace
    def _dp_train_step(self, data):
        """One logical private step on ``data`` (a logical batch).

        With ``gradient_accumulation_steps = k`` the batch is processed as k micro-batches in
        a sequential loop (only one micro-batch's activations live at a time); their clipped
        sums are added up and the optimizer adds noise once and records the step with the q
        that fit / train_on_batch declared for the steps of Keras' train function they run
        (q = 1, no amplification, for any other step: a custom loop, before or after fit).
        """
        # The sampling declared by fit / train_on_batch applies only to the steps of Keras'
        # train function they run (``_dp_declared_step``); any other step (a custom loop over
        # train_step, eager or traced, before or after a fit) was not sampled by tf_dp: q = 1.
        expected, q, _, fixed_shape = _active_sampling(self) or (None, None, False, False)
        if _internals.compiling_with_xla() and not fixed_shape:
            # Traced once per input signature: said then, and kept in the budget's caveats.
            self._dp_caveat(_XLA_SHAPES_CAVEAT)
            warnings.warn("tf_dp: " + _XLA_SHAPES_CAVEAT, UserWarning, stacklevel=2)
        phase = None
        if isinstance(q, tuple):
            # A batch-size schedule: every batch comes with the phase it was sampled in.
            data, phase = data
            if phase.shape.rank == 1:
                # Under tf.distribute (see fit): one replica holds the [1] phase, the others
                # an empty vector; the sum over replicas is the phase on every replica.
                phase = tf.reduce_sum(tf.cast(phase, tf.int32))
                context = tf.distribute.get_replica_context()
                if context is not None and context.num_replicas_in_sync > 1:
                    phase = context.all_reduce(tf.distribute.ReduceOp.SUM, phase)
            expected = tf.gather(tf.constant(expected, tf.float32), phase)
            q = list(q)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        opt = _dp_optimizer_of(self.optimizer)
        if opt is None:
            raise TypeError("A private model must be compiled with a tf_dp DP optimizer.")
        self._dp_claim_variables()
        _note_custom_code(self, opt)
        if not tf.executing_eagerly() and not independence.checks_attempted(self):
            raise ValueError(
                "tf_dp: this private step is being traced (a tf.function or a custom training "
                "loop) for a model that was never checked for layers that mix examples (a "
                "batch statistic, a time-major or batch-permuted layer: one example could "
                "then move the update by more than the clipping norm). fit() and "
                "train_on_batch() run the check themselves; before a traced custom loop, call "
                "model.check_before_training(x, y) on a real batch (or run one step "
                "eagerly), and again after changing which layers are trainable.")
        carrier = carriers.carrier_for(self)
        carrier.begin_step()  # RGP: carriers of this step, from the historical update
        variables = carrier.privatized
        k = opt.accumulation_steps
        # One secret draw of JL directions per logical step, shared by its micro-batches.
        jl_seed = opt.next_jl_seed() if opt.num_projections is not None else None
        max_rows = getattr(self, "_dp_max_rows", None)
        if not opt.built:
            # Keras builds the optimizer in its first apply, inside the traced step. Here it is
            # built before, out of the trace (init_scope): adaptive clipping reads its C
            # variable before the apply, and XLA cannot lift variables created inside the
            # private step's conditionals (DPAdam with jit_compile=True failed: "failed to
            # lift variable creations").
            with tf.init_scope():
                opt.build(carrier.trainable)
        # C of this step, read once: every micro-batch is clipped to it and the noise scaled
        # by it (adaptive clipping moves it only after the step's update).
        clip = opt.current_clip()
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            # An eager custom loop: the same check fit() runs (cached after its first run),
            # before the step's own forward pass, which a refused model must not run on the
            # batch (a write from the data would already be in its variables).
            independence.check_before_private_training(self, x, y, sample_weight,
                                                       self._dp_loss, variables=variables)
        if k == 1 and max_rows is None:
            # One part: JL may draw a table's directions on its looked-up rows alone.
            with jl.one_part_step():
                grads, count = self._dp_micro_step(x, y, sample_weight, variables, jl_seed,
                                                   clip)
        else:
            grads, count = self._dp_accumulate(x, y, sample_weight, variables, k, jl_seed,
                                               max_rows, clip)
        _refuse_data_dependent_losses(self)
        if expected is None:
            # Not sampled by tf_dp (q = 1): the realised size is treated as public and is the
            # divisor; an empty batch releases its noise divided by 1 (not by 0: NaN weights).
            expected = tf.maximum(_global_count(private_step.batch_size_of(x)), 1.0)
        snr_kind = getattr(self, "_dp_gradient_snr", None)
        # q is the one fit / train_on_batch declared for this step (its sampler's, or noted
        # as declared by the caller of fit), or 1: not the caller's word to apply_private.
        with dp_optimizer_lib.sampled_by_train_step(opt):
            snr = opt.apply_private(grads, variables, expected, sampling_probability=q,
                                    carrier=carrier,
                                    extra_gradients=_regularization_gradients(
                                        carrier.trainable),
                                    clip_count=count, clip=clip, gradient_snr=snr_kind,
                                    phase=phase)
        logs = self.get_metrics_result()
        if phase is not None:
            logs = {**logs, "batch_size": expected}  # the progress bar shows the phase's size
        if snr is not None:
            logs = {**logs, "gradient_snr": snr}
        if opt.adaptive_clipping is not None:
            # The clip the next step uses (post-processing of released values), in History.
            logs = {**logs, "l2_norm_clip": opt.current_clip()}
        return logs

    def _dp_micro_step(self, x, y, sample_weight, variables, jl_seed=None, clip=None):
        """(clipped sums, centred count of unclipped examples, or 0 without adaptive
        clipping) of one micro-batch."""
        opt = _dp_optimizer_of(self.optimizer)
        clip = opt.current_clip() if clip is None else clip

        def nothing():
            # No examples: a sum of zero, and no model call. A layer need not handle zero
            # rows: oneDNN's convolutions return their input for an empty batch (TF 2.21),
            # which crashed convolutional models on empty Poisson batches and empty parts.
            return ([tf.zeros(v.shape, ghost.SUM_DTYPE) for v in variables],
                    tf.constant(0.0, tf.float64))

        def examples():
            return self._dp_examples_step(x, y, sample_weight, variables, jl_seed, clip, opt)

        n = private_step.batch_size_of(x)
        if not isinstance(n, int):
            # The metrics need no update on no rows (it would add zeros); the tf.cond traces
            # the other branch, which builds them.
            return tf.cond(n > 0, examples, nothing)
        if n > 0:
            return examples()
        # Known to be empty (eager, or a static shape): this may be the first step, so the
        # metrics are built by an empty update.
        self._dp_build_metrics_on_nothing(x, y)
        return nothing()

    def _dp_build_metrics_on_nothing(self, x, y):
        """An empty metrics update (it builds Keras' compiled metrics), with outputs of zero
        rows shaped by the model's output spec; skipped if there is no spec."""
        try:
            spec = self.compute_output_spec(tf.nest.map_structure(
                lambda t: None if t is None else keras.KerasTensor(
                    (None,) + tuple(t.shape[1:]), t.dtype), x))
            y_pred = tf.nest.map_structure(
                lambda s: tf.zeros([0] + list(s.shape[1:]), s.dtype), spec)
        except Exception as e:  # noqa: BLE001 (a model that cannot be run symbolically)
            _LOG.debug("tf_dp: no output spec for an empty batch's metrics (%s)", e)
            return
        self._dp_update_metrics(x, y, private_step.ClippedSum(
            grads=[], losses=tf.zeros([0]), y_pred=y_pred, norms=tf.zeros([0])), None)

    def _dp_examples_step(self, x, y, sample_weight, variables, jl_seed, clip, opt):
        """``_dp_micro_step`` of a micro-batch of at least one row."""
        result = loss_scale_lib.scaled_clipped_sum(
            self, x, y, sample_weight, self._dp_loss, opt.clip_spec(variables, clip),
            loss_scale=getattr(self, "_dp_loss_scale", None), variables=variables,
            norm_strategy=opt.norm_strategy, seed=jl_seed,
            # max_physical_batch_size: every part at the one physical size (a memory cap)
            min_rows=getattr(self, "_dp_max_rows", None))
        self._dp_update_metrics(x, y, result, sample_weight)
        if opt.adaptive_clipping is None:
            return result.grads, tf.constant(0.0, tf.float64)
        return result.grads, clipping.centred_count(result.norms, clip, sample_weight)

    def _dp_accumulate(self, x, y, sample_weight, variables, k, jl_seed=None, max_rows=None,
                       clip=None):
        """Clipped sums of the logical batch in parts: k equal parts, or with ``max_rows``
        as many parts of at most ``max_rows`` examples as the realised batch needs."""
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        if max_rows is not None:
            k = tf.maximum(1, (n + max_rows - 1) // max_rows)

        def part(structure, j):
            if max_rows is None:
                lo, hi = (j * n) // k, ((j + 1) * n) // k
            else:
                lo, hi = j * max_rows, tf.minimum((j + 1) * max_rows, n)
            return tf.nest.map_structure(lambda t: None if t is None else t[lo:hi], structure)

        def body(j, count, *acc):
            grads, c = self._dp_micro_step(part(x, j), part(y, j), part(sample_weight, j),
                                           variables, jl_seed, clip)
            return (j + 1, count + c, *[a + g for a, g in zip(acc, grads)])

        # Accumulated in float64 (ghost.SUM_DTYPE, the micro-batches' sums' dtype): a float32
        # accumulator of huge logical batches would round their sums before the noise.
        zeros = [tf.zeros(v.shape, ghost.SUM_DTYPE) for v in variables]
        # The parts share the step's JL seed: JL draws whole table directions here (no
        # jl.one_part_step), so that a table row gets one vector in every part.
        out = tf.while_loop(lambda j, *acc: j < k, body,
                            (tf.constant(0), tf.constant(0.0, tf.float64), *zeros),
                            parallel_iterations=1)
        return list(out[2:]), out[1]

    def _dp_update_metrics(self, x, y, result, sample_weight):
        y_pred, losses = result.y_pred, result.losses
        if sample_weight is not None:
            # Rows of weight 0 (Poisson padding) are not examples: keep them out of every
            # metric, including Keras' unweighted `metrics=`.
            # (any non-zero entry: per-timestep weights may start with 0, left padding)
            keep = private_step.real_rows(sample_weight)
            included = tf.reduce_sum(tf.cast(keep, result.losses.dtype))
            take = lambda s: tf.nest.map_structure(
                lambda t: None if t is None else tf.boolean_mask(t, keep), s)
            x, y, y_pred, sample_weight = take(x), take(y), take(y_pred), take(sample_weight)
            losses = tf.boolean_mask(losses, keep)  # a padding row's loss may be NaN
        else:
            included = tf.cast(tf.shape(result.losses)[0], result.losses.dtype)
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(losses), included)
        _internals.loss_tracker(self).update_state(mean_loss, sample_weight=included)
        compile_loss = _internals.compile_loss(self)
        if compile_loss is not None and len(tf.nest.flatten(y_pred)) > 1:
            # Several outputs: Keras' per-output losses ("a_loss", ...) in the logs, as plain
            # Keras reports them (computed on the outputs only; no gradient flows from here).
            compile_loss(y, tf.nest.map_structure(tf.stop_gradient, y_pred), sample_weight)
        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def compile_from_config(self, config):
        """Re-compiles a loaded model (``compile`` is overridden, so Keras would skip it)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)


_ANALYSIS_CAVEAT = (
    "ANALYSIS_LOGS: {names} logged statistics of the raw (unclipped, un-noised) gradient of "
    "its analysis batch into the training logs (History, CSVLogger, TensorBoard). If that "
    "batch is private data, those logs are outside epsilon: keep them out of anything you "
    "release, or give the callback public data. The model itself is unaffected.")

_EXACT_SNR_CAVEAT = (
    "EXACT_GRADIENT_SNR: fit(gradient_snr='exact') logged the norm of the un-noised clipped "
    "gradient sum of every step, a statistic of the training data outside epsilon; use "
    "gradient_snr='private' (estimated from the noised update) for private data.")


#: under XLA fit pads its Poisson batches to a size they exceed with at most this
#: probability per step (a larger batch is padded to the next multiple: another shape)
_XLA_PAD_TAIL = 1e-12

_XLA_SHAPES_CAVEAT = (
    "XLA_BATCH_SHAPES: a private step ran under XLA (jit_compile=True) on batches whose "
    "number of rows follows the data. XLA's CPU kernels round a row differently for "
    "different batch sizes, so an example crafted to make its gradient mostly rounding "
    "moves with the number of other examples in its batch, and one example can then move "
    "the update by more than the clipping norm (measured: 1.48 C). fit() on arrays pads "
    "its Poisson batches to one size under XLA; for a dataset use "
    "tf_dp.data.PoissonSampler(..., pad_to=...) with a pad_to its batches exceed with "
    "probability below 1e-12 (tf_dp.data.poisson.safe_pad_to(N, q, tail=1e-12)), or train "
    "without jit_compile.")


def _one_shape_pad_to(model, schedule, x, expected_size, fixed_batch_shape=False):
    """The padded batch size of fit's own Poisson batches: under XLA, or with
    ``fixed_batch_shape=True``, one size they exceed with probability at most
    ``_XLA_PAD_TAIL`` (``_XLA_SHAPES_CAVEAT``); None otherwise (and with a batch-size
    schedule, whose phases have sizes of their own). The sampler puts a padded batch's rows
    in a secret random order (``poisson._shuffled_rows``)."""
    if schedule is not None:
        return None
    if not model.jit_compile and not fixed_batch_shape:
        return None
    from tf_dp.data.poisson import safe_pad_to  # noqa: PLC0415 (a cycle)

    n = len(tf.nest.flatten(x)[0])
    return safe_pad_to(n, min(1.0, expected_size / n), tail=_XLA_PAD_TAIL)


def _check_fixed_batch_shape_input(x, poisson_sampling, schedule):
    """Refuses ``fixed_batch_shape=True`` where fit does not draw the batches itself."""
    from tf_dp.data.poisson import PoissonSampler  # noqa: PLC0415 (a cycle)

    if isinstance(x, PoissonSampler) or isinstance(x, tf.data.Dataset) or not (
            _is_array_like(x)):
        raise ValueError(
            "`fixed_batch_shape=True` pads the Poisson batches fit draws from arrays; for a "
            "PoissonSampler or a dataset, build the sampler with pad_to="
            "tf_dp.data.poisson.safe_pad_to(N, q, tail=1e-12) instead.")
    if not poisson_sampling:
        raise ValueError("`fixed_batch_shape=True` needs poisson_sampling=True: fixed "
                         "batches already have one size, but no proven guarantee.")
    if schedule is not None:
        raise ValueError("`fixed_batch_shape=True` is not supported with a batch-size "
                         "schedule (its phases have sizes of their own); train each phase "
                         "in a fit of its own.")


def _note_analysis_callbacks(model, callbacks):
    """tf_dp.analysis callbacks log statistics of the raw gradient of their own batch into
    History: named in the report (``ANALYSIS_LOGS``, non-voiding, as ``EXACT_GRADIENT_SNR``:
    the model is unaffected; the logs are outside epsilon if that batch is private)."""
    from tf_dp.analysis import GradientGeometry, GradientSpectrum

    names = sorted({type(c).__name__ for c in callbacks
                    if isinstance(c, (GradientGeometry, GradientSpectrum))})
    if names:
        model._dp_caveat(_ANALYSIS_CAVEAT.format(names=", ".join(names)))


def _note_class_weight(model, class_weight):
    """``class_weight`` is the caller's word that it does not come from the training data
    (a warning and the non-voiding caveat ``CLASS_WEIGHT_ASSUMED``)."""
    if class_weight is None:
        return
    model._dp_caveat(_CLASS_WEIGHT_CAVEAT)
    warnings.warn("tf_dp: " + _CLASS_WEIGHT_CAVEAT[len("CLASS_WEIGHT_ASSUMED: "):],
                  UserWarning, stacklevel=3)


def _class_weights(y, class_weight):
    """Per-example weights of ``class_weight`` (a dict class -> weight) for labels ``y``, as
    Keras forms them: one-hot rows by their argmax, other labels rounded; absent classes 1."""
    labels = np.asarray(keras.ops.convert_to_numpy(y))
    if labels.ndim > 1:
        labels = (np.argmax(labels, axis=-1) if labels.shape[-1] != 1
                  else np.squeeze(labels, axis=-1))
    labels = np.round(labels).astype(np.int64)
    return np.array([float(class_weight.get(int(c), 1.0)) for c in labels], np.float32)


def _fixed_batch_shape(sampler) -> bool:
    """Whether every batch of this fit has the same number of rows, but for a bad event
    of probability at most ``_XLA_PAD_TAIL`` per step: a PoissonSampler's padded batches
    (its own, or a dataset made by it with nothing between that changes the batch)."""
    if sampler is None or sampler.pad_to is None or sampler.schedule is not None:
        return False
    from scipy import stats  # noqa: PLC0415

    tail = stats.binom.sf(sampler.pad_to, int(sampler.dataset_size),
                          float(sampler.sampling_probability))
    return bool(tail <= _XLA_PAD_TAIL)


def _check_declared_size(x, dataset_size, sampling_probability, poisson_sampling):
    """Refuses a ``dataset_size`` or ``sampling_probability`` that tf_dp would not use or
    that contradicts what it can see. Arrays: their N is their length (a larger
    ``dataset_size`` gave fixed batches a q, and an epsilon, up to N / len(x) times too
    small), and tf_dp samples them itself at q = batch_size / N. A PoissonSampler (or a
    dataset made by one) has its own N and q."""
    from tf_dp.data.poisson import PoissonSampler, sampler_of  # noqa: PLC0415 (a cycle)

    sampler = x if isinstance(x, PoissonSampler) else (
        sampler_of(x) if isinstance(x, tf.data.Dataset) else None)
    if sampler is not None:
        if dataset_size is not None and dataset_size != sampler.dataset_size:
            raise ValueError(
                f"`dataset_size`={dataset_size!r}, but this input's PoissonSampler samples "
                f"{sampler.dataset_size} examples; leave `dataset_size` out.")
        if sampling_probability is not None:
            raise ValueError("`sampling_probability` is not used with a PoissonSampler (it "
                             "has its own q); leave it out.")
        return
    if not _is_array_like(x):
        return
    rows = len(tf.nest.flatten(x)[0])
    if dataset_size is not None and dataset_size != rows:
        raise ValueError(
            f"`dataset_size`={dataset_size!r}, but `x` has {rows} rows: for arrays the data "
            f"set's size is their length; leave `dataset_size` out.")
    if sampling_probability is not None and poisson_sampling:
        raise ValueError(
            "`sampling_probability` is not used for arrays: fit() Poisson-samples them "
            "itself at q = batch_size / len(x). Set the expected batch with `batch_size`.")


def _fixed_batch_sampling(x, batch_size, validation_split, dataset_size, sampling_probability):
    """(q, expected logical batch or None, poisson?) for inputs tf_dp does not sample.

    q is never guessed from a dataset's cardinality (a repeated or endless dataset would
    give a wrong one): datasets and other iterables need ``dataset_size``.
    """
    if sampling_probability is not None and dataset_size is None:
        raise ValueError("`sampling_probability` needs `dataset_size` too (the expected batch "
                         "size q * N divides the noisy sum).")
    if dataset_size is not None:
        dataset_size = _validation.positive_int(dataset_size, "dataset_size")
    if sampling_probability is not None:
        sampling_probability = _validation.sampling_probability(sampling_probability)
        return float(sampling_probability), float(sampling_probability) * dataset_size, True
    if isinstance(x, tf.data.Dataset):
        if dataset_size is None:
            raise ValueError(
                "This tf.data.Dataset was not made by a tf_dp.data.PoissonSampler, so tf_dp "
                "cannot tell its sampling rate: pass `dataset_size=N` to fit() (q = batch / N, "
                "accounted as if batches were Poisson samples), or build the input with "
                "tf_dp.data.PoissonSampler (maps and prefetch after it are fine).")
        batch = tf.nest.flatten(x.element_spec)[0].shape[0]
        if batch is None:
            first = next(iter(x.take(1)))
            batch = int(tf.nest.flatten(first)[0].shape[0])
        n = dataset_size
    elif _is_array_like(x):
        n = dataset_size or len(tf.nest.flatten(x)[0])
        n = int(n * (1.0 - (validation_split or 0.0)))
        batch = batch_size
    else:
        if dataset_size is None or batch_size is None:
            raise ValueError("For this input type pass `dataset_size=N` and `batch_size` "
                             "to fit() so epsilon can be computed.")
        n, batch = dataset_size, batch_size
    return min(1.0, batch / n), None, False


def _limit_steps(fit_args, steps):
    """The input of ``fit_args`` cut to ``steps`` logical batches (a tf.data.Dataset);
    ``steps`` a Python int, or an int64 ``tf.Variable`` read as each batch is drawn."""
    x = fit_args["x"]
    if isinstance(steps, tf.Variable):
        return x.enumerate().take_while(lambda i, _: i < steps).map(lambda _, e: e)
    if isinstance(x, tf.data.Dataset):
        return x.take(steps)
    if _is_array_like(x):
        parts = tuple(p for p in (x, fit_args.get("y"), fit_args.get("sample_weight"))
                      if p is not None)
        n = len(tf.nest.flatten(x)[0])
        ds = tf.data.Dataset.from_tensor_slices(parts)
        if fit_args.get("shuffle", True):
            ds = ds.shuffle(n, reshuffle_each_iteration=True)
        return ds.batch(fit_args.get("batch_size") or 32).repeat().take(steps)
    return x


def _empty_history(model):
    history = keras.callbacks.History()
    history.set_model(model)
    history.on_train_begin()
    model.history = history
    return history


_SHARED_COMPOSED = (
    "tf_dp: two private models trained the same variables under different budgets (each "
    "had spent steps of its own): their steps are composed in the budget they now share.")

#: id(variable) -> (weakref to the variable, the budget its private steps are spent in).
_VARIABLE_BUDGETS = {}
_CLAIM_LOCK = threading.RLock()


def _forget_variable(key):
    def forget(ref):
        with _CLAIM_LOCK:
            entry = _VARIABLE_BUDGETS.get(key)
            if entry is not None and entry[0] is ref:
                del _VARIABLE_BUDGETS[key]
    return forget


_ACTIVE = threading.local()


def _active_sampling_stack():
    """This thread's (model, declared sampling) of the Keras train steps being run (a
    replica of tf.distribute runs its step in a thread of its own)."""
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    return stack


def _active_sampling(model):
    for owner, sampling in reversed(_active_sampling_stack()):
        if owner is model:
            return sampling
    return None


class _declared_sampling:
    """While fit / train_on_batch runs Keras' train function, that function's steps take
    the declared sampling (``make_train_function``)."""

    def __init__(self, model):
        self._model = model

    def __enter__(self):
        object.__setattr__(self._model, "_dp_in_keras_loop", True)
        object.__setattr__(self._model, "_dp_armed", False)

    def __exit__(self, *exc):
        object.__setattr__(self._model, "_dp_in_keras_loop", False)
        object.__setattr__(self._model, "_dp_armed", False)
        return False


def _stop_if_the_target_is_reached(model):
    """Before a call of fit's own steps: once steps fit did not plan ran (a callback's own),
    fit's step limit is stale; from then on every call is checked against the budget as it
    is, at the costliest mechanism fit's steps may take. When it no longer affords one
    call's steps, training stops here (Keras ends the epoch on StopIteration, then sees
    ``stop_training``)."""
    mechanisms = model.__dict__.get("_dp_fit_mechanisms")
    if not mechanisms:
        return
    per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    if model.__dict__.get("_dp_unplanned_steps", False):
        object.__setattr__(model, "_dp_unplanned_steps", False)
        model._dp_drain()
        object.__setattr__(model, "_dp_fit_allowance", model._dp_remaining_steps(
            budget_lib.costliest(mechanisms)))
    allowance = model.__dict__.get("_dp_fit_allowance")
    if allowance is None:
        return
    if allowance < per_call:
        model.stop_training = True
        _LOG.warning("tf_dp: stopping: steps run outside fit's plan (a callback's own) leave "
                     "too little of the target epsilon %g for another step.",
                     model.target_epsilon)
        raise StopIteration
    object.__setattr__(model, "_dp_fit_allowance", allowance - per_call)


def _arm_declared_step(model):
    """The next call of ``model``'s train function is Keras' own (see
    ``make_train_function``)."""
    object.__setattr__(model, "_dp_armed", True)


class _ArmDeclaredStep(keras.callbacks.Callback):
    """fit's last callback: arms the train function call Keras makes right after the
    batch-begin hooks (``make_train_function``). A call a callback makes itself, in any
    hook, is not armed and is accounted at q = 1."""

    def on_train_batch_begin(self, batch, logs=None):
        _arm_declared_step(self.model)


def _refuse_another_models_optimizer(model, optimizer):
    """Refuses a DP optimizer whose steps another private model's budget reads: one ledger
    is read by one budget, so steps applied to either model would be reported by whichever
    read it first (session 21 audit: a model reported 3 steps it never took, the other 4 of
    the 7 its weights had). Models that share variables share one budget and may."""
    owner = budget_lib.owner_of(optimizer)
    if owner is None or owner is model._dp_budget_obj().current():
        return
    if model.built:
        model._dp_claim_variables()  # shared variables join the two budgets
        if owner is model._dp_budget_obj().current():
            return
    raise ValueError(
        f"tf_dp: this {type(optimizer).__name__} already records the steps of another private "
        "model, whose privacy budget reads them. Give each model its own optimizer instance "
        "(e.g. type(optimizer).from_config(optimizer.get_config())).")


def _refuse_nested(model, what):
    """Refuses ``fit`` / ``train_on_batch`` while this model's fit or train_on_batch runs
    (from a callback): it would re-declare the sampling, and retrace the step, under the
    outer fit's remaining steps (session 21 audit: a nested fit left the outer fit's
    q = 1/2 batches accounted at q = 1/16)."""
    if model.__dict__.get("_dp_in_keras_loop", False):
        raise RuntimeError(
            f"tf_dp: {what}() was called while this model's fit() is running (from a "
            "callback). It would change the sampling that the running fit's remaining steps "
            "are accounted at. Train again after fit() returns.")


class _BudgetCheckpoint(tf.__internal__.tracking.Trackable):
    """The model's spent budget in a ``tf.train.Checkpoint`` (and ``CheckpointManager``) of
    the model: saved as its JSON config beside the weights; restoring merges it into the
    model's budget (``PrivacyBudget.merge``: the larger record, never a lower one), as loading
    a .keras or .weights.h5 file does."""

    def __init__(self, model):
        self._model = weakref.ref(model)

    def _serialize_to_tensors(self):
        with tf.init_scope():  # the drain reads the ledger on the host
            model = self._model()
            blob = "" if model is None else json.dumps(model.privacy_budget.get_config())
            value = tf.constant(blob, dtype=tf.string)
        return {"record": value}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors["record"]
        if not tf.executing_eagerly() or not hasattr(value, "numpy"):
            raise RuntimeError(
                "tf_dp: a private model's spent budget can only be restored from a "
                "tf.train.Checkpoint eagerly (not inside a tf.function or graph).")
        blob = value.numpy().decode()
        model = self._model()
        if blob and model is not None:
            model.privacy_budget.merge(json.loads(blob))
        return tf.no_op()

    def _copy_trackable_to_cpu(self, object_map):
        # Async checkpoints (CheckpointOptions(experimental_enable_async_checkpoint=True))
        # copy the state to save: the budget at the time of the save.
        copy = _FrozenBudget(self._serialize_to_tensors()["record"])
        object_map[self] = copy


class _FrozenBudget(tf.__internal__.tracking.Trackable):
    def __init__(self, value):
        self._value = value

    def _serialize_to_tensors(self):
        return {"record": self._value}


class _StoreWithout:
    """A weights store minus one key (the budget), for Keras' own variable loading."""

    def __init__(self, store, key):
        self._store, self._key = store, key

    def keys(self):
        return [k for k in self._store.keys() if k != self._key]

    def __len__(self):
        return len(self.keys())

    def __contains__(self, key):
        return key != self._key and key in self._store

    def __getitem__(self, key):
        if key == self._key:
            raise KeyError(key)
        return self._store[key]


def _output_names(model):
    """The names a dict ``loss`` refers to: a functional model's output dict keys (which
    need not be its output layers' names), else ``output_names``."""
    try:
        structure = model.output  # raises for a model never called (Sequential, subclassed)
    except (AttributeError, ValueError, RuntimeError):
        structure = None
    if isinstance(structure, dict):
        return list(structure.keys())
    return getattr(model, "output_names", None)


def _dp_optimizer_of(optimizer):
    """The tf_dp optimizer, also inside Keras' LossScaleOptimizer; None if there is none."""
    if isinstance(optimizer, DPOptimizerMixin):
        return optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    return inner if isinstance(inner, DPOptimizerMixin) else None


def _custom_name(layer):
    """The name of ``layer``'s ``call`` if it is code from outside Keras and tf_dp, else None."""
    if isinstance(layer, keras.layers.Lambda):
        return f"Lambda({getattr(layer.function, '__name__', '?')})"
    owner = next((c for c in type(layer).__mro__ if "call" in c.__dict__), None)
    module = (getattr(owner, "__module__", None) or "") if owner is not None else "keras."
    return None if module.startswith(("keras.", "tf_dp.", "tensorflow.")) else (
        type(layer).__name__)


def custom_code(model) -> list:
    """Names of the layers of ``model`` (itself included) whose ``call`` is code from outside
    Keras and tf_dp: custom layer classes, ``Lambda`` functions, a subclassed model's
    ``call``. Their per-example independence is checked on the first batch only."""
    names = {_custom_name(layer) for layer in _internals.all_layers(model, include_self=True)}
    return sorted(names - {None})


def custom_state(model) -> list:
    """Names of the custom layers of ``model`` (as :func:`custom_code`) that hold
    non-trainable variables other than seed generators' states: state their own code could
    write from the data."""
    names = set()
    for layer in _internals.all_layers(model, include_self=True):
        name = _custom_name(layer)
        seeds = independence.seed_states(layer)
        if name is not None and any(not any(v is s for s in seeds)
                                    for v in layer.non_trainable_weights):
            names.add(name)
    return sorted(names)


def _note_custom_code(model, opt):
    """The PER_EXAMPLE_ASSUMED caveat when custom code runs on a path that computes
    per-example quantities from the batched forward and backward pass (every strategy but
    the vectorized one, which runs each example alone); STATE_ASSUMED when custom layers
    hold non-trainable state (every strategy: the vectorized pass writes it too)."""
    from tf_dp.core import norm_strategies  # noqa: PLC0415

    holders, layers, outside = [], custom_state(model), independence.outside_state(model)
    if layers:
        holders.append(f"custom layers ({', '.join(layers)}) hold non-trainable variables")
    if outside:
        holders.append(f"the training pass uses variables outside the model "
                       f"({', '.join(outside)})")
    if holders:
        model._dp_caveat(_STATE_CAVEAT.format(what="; ".join(holders)))
    if isinstance(opt.norm_strategy, norm_strategies.Vectorized):
        return
    names = custom_code(model)
    if names:
        model._dp_caveat(_PER_EXAMPLE_CAVEAT.format(names=", ".join(names)))


_PER_EXAMPLE_CAVEAT = (
    "PER_EXAMPLE_ASSUMED: custom code ({names}) runs in a step whose per-example norms come "
    "from the batched pass (layer formulas or JL). tf_dp checked on the first batch that the "
    "model acts on each example separately; code that mixes examples only for some input "
    "values passes that check, so the guarantee assumes this code never mixes examples. "
    "norm_strategy='vmap' runs every example alone and needs no such assumption "
    "(docs/privacy.md).")

_CLASS_WEIGHT_CAVEAT = (
    "CLASS_WEIGHT_ASSUMED: class_weight was given. Weights computed from the training labels "
    "(inverse class frequencies) are a statistic of the data outside epsilon, and one "
    "example then changes the weight of every example of its class, so its influence on the "
    "clipped sum is not bounded by the clipping norm; the guarantee assumes the weights come "
    "from public information (docs/privacy.md).")

_UNCHECKED_CAVEAT = (
    "UNCHECKED: tf_dp could not run its checks that the model treats the examples of a batch "
    "independently and writes no state from the data (fit's warning says why: input that "
    "cannot be read ahead, fewer than two rows, a forward pass that cannot be replayed), so "
    "the guarantee is not established: a model that mixes examples moves the clipped sum by "
    "more than the clipping norm. Remove the cause the warning names (pass arrays or a "
    "PoissonSampler, draw randomness from keras.random with a SeedGenerator) and train again "
    "(docs/privacy.md).")

_STATE_CAVEAT = (
    "STATE_ASSUMED: {what}. tf_dp checked on "
    "the first batch that a training-mode pass does not write them from the data (such state "
    "would be released with the model without noise); a write that happens only for some "
    "input values passes that check, so the guarantee assumes this code never writes its "
    "state from the data (docs/privacy.md).")

_SEEDED_CAVEAT = (
    "SEEDED: a DP optimizer or sampler of this run was given a seed: anyone holding the seed "
    "can regenerate the noise (and the samples), so the reported epsilon does NOT hold.")


def _refuse_data_dependent_losses(model):
    for layer in _internals.all_layers(model):
        if _internals.added_losses(layer):
            raise ValueError(
                f"Layer {layer.name!r} added a loss during the forward pass (add_loss or "
                "activity_regularizer). Such losses depend on the data but are not per-example, "
                "so they cannot be clipped; remove them for private training (weight "
                "regularizers are fine).")


def _regularization_gradients(variables):
    """{id(v): gradient of v's weight regulariser}: data independent, added after noise."""
    out = {}
    for v in variables:
        r = getattr(v, "regularizer", None)
        if r is None:
            continue
        with tf.GradientTape() as tape:
            tape.watch(v.value)
            penalty = r(v.value)
        out[id(v)] = tape.gradient(penalty, v.value)
    return out


# ------------------------------------------------------------------ multi-worker training


class _ScheduleStart(keras.callbacks.Callback):
    """Sets the step a batch-size schedule's sampler starts at to the optimizer's step count
    once training begins (after any BackupAndRestore restore: this callback comes after the
    user's)."""

    def __init__(self, start, optimizer, retarget=None):
        super().__init__()
        self._start, self._optimizer, self._retarget = start, optimizer, retarget

    def on_train_begin(self, logs=None):
        start = int(keras.ops.convert_to_numpy(self._optimizer.iterations))
        self._start.assign(start)
        if self._retarget is not None:
            # With a target epsilon: the steps from this start, never more than planned.
            self._retarget(start)


def _multi_worker_input_context(model):
    """The worker's `tf.distribute.InputContext` under a multi-worker strategy, else None."""
    strategy = model.distribute_strategy
    if not _internals.in_multi_worker_mode(strategy):
        return None
    return _internals.worker_input_context(strategy)


def _check_multi_worker_input(context, x, poisson_sampling, schedule, validation_split,
                              validation_data, dataset_size, sampling_probability):
    """Refuses multi-worker inputs whose sampling across workers tf_dp cannot vouch for."""
    if context.num_replicas_in_sync % context.num_input_pipelines:
        raise ValueError(
            f"Multi-worker private training needs the same number of replicas on every "
            f"worker (each worker's sample is split over its own replicas); this cluster has "
            f"{context.num_input_pipelines} workers and {context.num_replicas_in_sync} "
            "replicas.")
    if validation_data is not None and (
            isinstance(validation_data, tf.distribute.DistributedDataset)
            or hasattr(validation_data, "_input_contexts")):
        raise ValueError(
            "Under MultiWorkerMirroredStrategy `validation_data` must be arrays or a "
            "tf.data.Dataset: every worker then evaluates all of it (a distributed dataset "
            "would split it in a way tf_dp cannot check).")
    if isinstance(x, tf.distribute.DistributedDataset) or hasattr(
            x, "_input_contexts"):  # DistributedDatasetsFromFunction
        if _local_replicas(context) > 1:
            # Each of a worker's replicas takes its own element of a step: one sample split
            # over them, or one sample each (q times the replicas per worker, accounted as
            # q)? tf_dp cannot tell, so it does the splitting itself or not at all.
            raise ValueError(
                f"A distributed dataset under MultiWorkerMirroredStrategy needs one replica "
                f"per worker; this cluster has {_local_replicas(context)} per worker, whose "
                "elements of one step tf_dp cannot tell apart from several samples. Pass "
                "arrays: fit() then samples each worker's shard once per step and splits "
                "that sample over the worker's replicas.")
        if dataset_size is None or sampling_probability is None:
            raise ValueError(
                "A distributed dataset under MultiWorkerMirroredStrategy needs `dataset_size` "
                "(N of the whole data set) and `sampling_probability` (q): it declares that "
                "every worker yields Poisson samples at q of its own disjoint shard, which "
                "tf_dp cannot check (the privacy report says so). Or pass arrays: fit() then "
                "shards and samples them itself.")
        return
    if not (_is_array_like(x) and poisson_sampling):
        raise ValueError(
            "Under MultiWorkerMirroredStrategy fit() takes array inputs with "
            "poisson_sampling=True (every worker passes the same arrays; each samples only "
            "its own shard, rows w, w + W, w + 2W, ..., at q = batch_size / N, so each "
            "example is sampled with probability q once per step over the cluster), or a "
            "distributed dataset with `dataset_size` and `sampling_probability`; got "
            f"{type(x).__name__}" + ("" if poisson_sampling else " with poisson_sampling=False")
            + ". A dataset, or a PoissonSampler, on every worker would sample the same "
            "examples independently on each worker.")


def _on_every_worker(strategy, validation_data, batch_size):
    """The whole validation set for every worker's replica, unsplit.

    Keras would shard it over the workers, which can leave them different numbers of
    batches (and a collective one worker never joins) and makes the metrics depend on how
    Keras combines replicas. With the same batches on every replica, every way of combining
    them (sum of totals and counts, mean, first replica) gives the metrics of the whole set;
    the cost is that each worker evaluates all of it. (The validation rows are held out of
    training and their metrics carry no noise: outside the guarantee, as in one process.)
    """
    if isinstance(validation_data, tf.data.Dataset):
        local = validation_data
    else:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
        parts = (x, y) if sample_weight is None else (x, y, sample_weight)
        local = tf.data.Dataset.from_tensor_slices(parts).batch(batch_size)
    replicas = strategy.num_replicas_in_sync // _internals.num_workers(strategy)
    if replicas > 1:
        # Every local replica gets the same batch (one element per replica per step).
        local = local.flat_map(
            lambda *batch: tf.data.Dataset.from_tensors(batch[0] if len(batch) == 1 else batch)
            .repeat(replicas))
    return strategy.distribute_datasets_from_function(lambda context: local)


def _local_replicas(context):
    """Replicas per worker of an input context (the same on every worker, as checked)."""
    return max(1, context.num_replicas_in_sync // context.num_input_pipelines)


def _split_over_local_replicas(dataset, replicas, with_phase=False):
    """Each element (one logical batch of this worker, or (batch, phase)) as ``replicas``
    consecutive elements: rows j, j + L, j + 2L, ... for local replica j (an empty part is a
    valid part), the phase of a schedule unchanged on every part."""
    if replicas == 1:
        return dataset

    def parts(*element):
        element = element[0] if len(element) == 1 else element
        batch, phase = element if with_phase else (element, None)

        def part(j):
            rows = tf.nest.map_structure(lambda t: t[j::replicas], batch)
            return rows if phase is None else (rows, phase)

        return tf.data.Dataset.range(replicas).map(part)

    return dataset.flat_map(parts)


def _worker_shard_sampler(strategy, context, x, y, sample_weight, logical_batch, seed):
    """This worker's PoissonSampler: its shard of the rows, at q = logical_batch / N (a
    batch-size schedule: at each phase's size / N)."""
    from tf_dp.data.poisson import PoissonSampler

    n = len(tf.nest.flatten(x)[0])
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None and any(len(a) != n for a in tf.nest.flatten(value)):
            raise ValueError(f"`{name}` must have as many rows as `x` ({n}).")
    largest, smallest = _max_and_min_over_workers(strategy, n)
    if largest != smallest:
        # Different N on different workers: different q and divisors per worker, so the
        # replicas' updates (and accountants) would silently disagree.
        raise ValueError(f"Every worker must pass the same arrays to fit(): the workers hold "
                         f"between {smallest} and {largest} rows (this one {n}).")
    shard = slice(context.input_pipeline_id, None, context.num_input_pipelines)
    if seed is not None:
        # A seeded (debugging) run: each worker its own sampling stream. The same seed on
        # every worker drew the same inclusion coins for every shard (session 14 helper).
        seed = (seed * 1_000_003 + context.input_pipeline_id + 1) % (2**63)
    take = lambda structure: (None if structure is None
                              else tf.nest.map_structure(lambda a: a[shard], structure))
    if isinstance(logical_batch, PiecewiseBatchSize):
        return _shard_sampler(take(x), take(y), take(sample_weight), logical_batch, n, seed)
    q = min(1.0, logical_batch / n)
    return PoissonSampler(take(x), take(y), sample_weight=take(sample_weight),
                          sampling_probability=q,
                          steps_per_epoch=max(1, round(1.0 / q)), seed=seed)


def _shard_sampler(x, y, sample_weight, schedule, population, seed):
    """A worker's shard sampled, step by step, at the WHOLE data set's rates of a batch-size
    schedule, q_t = exact_rate(size_t / N) (the same on every worker, whatever its shard's
    size), each batch with its phase (the same on every worker: it follows the step)."""
    from tf_dp.data.poisson import PoissonSampler, exact_rate

    too_big = [b for b in schedule.batch_sizes if b > population]
    if too_big:
        raise ValueError(f"`batch_size` schedule has sizes {too_big} above the number of "
                         f"examples {population}.")
    rates = tuple(exact_rate(b / population) for b in schedule.batch_sizes)

    class ShardSampler(PoissonSampler):
        @property
        def phase_probabilities(self) -> tuple:
            return rates

    sampler = ShardSampler(x, y, sample_weight=sample_weight, sampling_probability=rates[0],
                           steps_per_epoch=max(1, round(population / schedule.batch_sizes[0])),
                           seed=seed)
    sampler.schedule = schedule  # its dataset() then samples step t at rates[phase(t)]
    return sampler


def _max_and_min_over_workers(strategy, n):
    """(max, min) of ``n`` over the replicas of a multi-worker ``strategy``."""

    @tf.function
    def gather():
        def replica_fn():
            return tf.distribute.get_replica_context().all_gather(
                tf.constant([n], tf.int64), axis=0)
        return strategy.run(replica_fn)

    every = strategy.experimental_local_results(gather())[0].numpy()
    return int(every.max()), int(every.min())


def _global_count(local):
    local = tf.cast(local, tf.float32)
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return local


def _is_array_like(x):
    if isinstance(x, dict):
        return all(_is_array_like(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_array_like(v) for v in x)
    return isinstance(x, (np.ndarray, tf.Tensor)) or (hasattr(x, "__array__") and not isinstance(
        x, tf.data.Dataset))


def _split_validation(x, y, sample_weight, split):
    n = len(tf.nest.flatten(x)[0])
    cut = int(n * (1.0 - split))
    head = lambda s: tf.nest.map_structure(lambda a: None if a is None else a[:cut], s)
    tail = lambda s: tf.nest.map_structure(lambda a: None if a is None else a[cut:], s)
    val = (tail(x), tail(y)) if sample_weight is None else (tail(x), tail(y),
                                                             tail(sample_weight))
    return (head(x), head(y), head(sample_weight)), val


@keras.saving.register_keras_serializable(package="tf_dp")
class DPModel(DPTrainMixin, keras.Model):
    """A Keras ``Model`` that trains with differential privacy.

    Use it like ``keras.Model``: functional (``DPModel(inputs, outputs)``) or subclassed
    (define ``call``). Compile it with a tf_dp optimizer; ``fit`` then clips each example's
    gradient (exact norms: layer formulas where known, vectorized per-example gradients for
    other layers), adds Gaussian noise once per logical step and Poisson-samples array inputs.

    Reference: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    """


    def __new__(cls, *args, **kwargs):
        # DPModel(inputs, outputs) is a functional model. Keras would make it one by
        # rewriting the bases of DPModel itself (Functional in place of Model), after which no
        # subclass of DPModel could be built without inputs in this process: use a class of
        # its own instead.
        if cls is DPModel and _functional_arguments(args, kwargs):
            return super().__new__(DPFunctional, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


def _functional_arguments(args, kwargs):
    return (len(args) == 2 or (len(args) == 1 and "outputs" in kwargs)
            or ("inputs" in kwargs and "outputs" in kwargs))


@keras.saving.register_keras_serializable(package="tf_dp")
class DPFunctional(DPModel, _internals.functional_class()):
    """What ``DPModel(inputs, outputs)`` and ``make_private`` of a functional model return:
    a functional Keras model with the private train step (an instance of ``DPModel``)."""


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSequential(DPTrainMixin, keras.Sequential):
    """A ``keras.Sequential`` that trains with differential privacy (see ``DPModel``)."""


def make_private(model: keras.Model, delta: float = None,
                 target_epsilon: float = None) -> keras.Model:
    """Returns a private version of ``model`` sharing its layers and weights.

    Functional and Sequential models become ``DPModel`` / ``DPSequential`` over the same
    layers (no copy of weights): use the returned model. A subclassed model gets a private
    train step installed on a new class derived from its own, so its ``call`` and state are
    kept: the returned model is ``model`` itself. A model already compiled with a tf_dp
    optimizer keeps its compile arguments.

    Args:
      model: a Keras model (functional, Sequential or subclassed).
      delta: the delta at which epsilon is reported in the training logs, in (0, 1);
        default 1e-5. A model that is already private keeps its own unless one is given
        (a change is warned about).
      target_epsilon: optional budget; ``fit`` stops before the step that would exceed it.
        A model that is already private keeps its own unless one is given (session 21
        audit: a second make_private dropped the target, and fit ran past it).

    Raises:
      TypeError: if ``model`` is not a ``keras.Model``.
      ValueError: if ``delta`` or ``target_epsilon`` is out of range, or ``model`` is compiled
        with a plain (non-private) optimizer.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if delta is not None:
        delta = _validation.delta(delta)
    if target_epsilon is not None:
        target_epsilon = _validation.positive_epsilon(target_epsilon)
    if isinstance(model, DPTrainMixin):
        # Already private: its budget's delta and target stay unless given anew.
        for name, new, old in (("delta", delta, model.privacy_delta),
                               ("target_epsilon", target_epsilon, model.target_epsilon)):
            if (new is not None and old is not None and float(new) != float(old)
                    and model.privacy_budget.accountant.steps):
                warnings.warn(f"tf_dp: make_private() changes this private model's {name} "
                              f"from {old:g} to {new:g}.", UserWarning, stacklevel=2)
        if delta is not None:
            model.privacy_delta = float(delta)
        if target_epsilon is not None:
            model.target_epsilon = float(target_epsilon)
        return model
    compile_config = None
    if getattr(model, "compiled", False) and not isinstance(model, DPTrainMixin):
        if _dp_optimizer_of(getattr(model, "optimizer", None)) is None:
            raise ValueError(
                f"`model` is already compiled with {type(model.optimizer).__name__}, a plain "
                "optimizer that would train without privacy: call make_private(model) first, "
                "then compile the private model with a tf_dp optimizer (e.g. tf_dp.DPAdam).")
        compile_config = model.get_compile_config()
    private = _private_version(model)
    if compile_config is not None:
        # The same compile arguments for the private train step (the DP optimizer, which has
        # taken no step, is rebuilt from its config).
        private.compile_from_config(compile_config)
    private.privacy_delta = 1e-5 if delta is None else float(delta)
    private.target_epsilon = None if target_epsilon is None else float(target_epsilon)
    return private


def _private_version(model):
    if isinstance(model, DPTrainMixin):
        return model
    if isinstance(model, keras.Sequential):
        private = DPSequential(model.layers, name=model.name)
        if model.built and not private.built and model.inputs:
            private.build(model.inputs[0].shape)
        return private
    if _internals.is_functional(model):
        # The input and output structures (a dict of outputs keyed otherwise than its
        # layers' names), not the flat lists: targets and losses refer to them.
        return DPModel(inputs=model.input, outputs=model.output, name=model.name)
    # Subclassed model: derive a private class so the instance keeps its own call/state.
    _internals.give_class(model, private_subclass(type(model)))
    return model


_PRIVATE_CLASSES = {}
_PRIVATE_PREFIX = "Private."


def private_subclass(cls):
    """The private version of a subclassed model class (made once per class), registered for
    Keras serialization as ``tf_dp>Private.<the class's registered name>``; its configs name
    the base class, so ``tf_dp.keras.load_model`` can remake it in a fresh process."""
    if cls not in _PRIVATE_CLASSES:
        base_name = keras.saving.get_registered_name(cls)

        def get_config(self):
            config = DPTrainMixin.get_config(self)
            config["tf_dp"]["base_class"] = base_name
            return config

        private = type(f"Private{cls.__name__}", (DPTrainMixin, cls),
                       {"get_config": get_config, "__module__": cls.__module__})
        name = _PRIVATE_PREFIX + base_name.replace(">", ".")
        _PRIVATE_CLASSES[cls] = keras.saving.register_keras_serializable(
            package="tf_dp", name=name)(private)
    return _PRIVATE_CLASSES[cls]
