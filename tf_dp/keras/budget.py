"""The privacy budget of a private model: what it has spent, and what that covers.

A ``PrivacyBudget`` holds the accountant fed by the optimizer's ledger (every applied step,
whatever loop ran it), the delta at which epsilon is reported, the optional target epsilon,
the caveats of the run (what is outside the proven guarantee) and a lineage id that
identifies the training history across saves and restores. It never goes down: restoring a
saved budget keeps the larger of the two records (``merge``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
import weakref

from tf_dp.accounting.functions import epsilon_text
from tf_dp.core import private_step
from tf_dp.keras.privacy_callback import max_additional_steps

#: caveats that void the proof for the released model (see ``PrivacyBudget.report``).
VOIDING = ("SEEDED", "FIXED_BATCHES", "ADAPTED_PREPROCESSING", "METRIC_STEERED",
           "XLA_BATCH_SHAPES", "XLA_AUTO_CLUSTERING", "MIXED_PRECISION_REWRITE",
           "TENSOR_FLOAT_32", "UNCHECKED", "OPAQUE_PYTHON")

#: the caveat of steps read after XLA auto-clustering was on (``_drain_ledger``)
XLA_AUTO_CLUSTERING_CAVEAT = (
    "XLA_AUTO_CLUSTERING: private steps were read after XLA auto-clustering was on "
    "({setting}). It compiles parts of a traced step for each batch shape, whose kernels "
    "round an example's gradient differently for different batch sizes, so one example "
    "could move an update by more than the clipping norm. tf_dp refuses to trace a step "
    "under it; this one was turned on after. Turn it off and use "
    "model.compile(jit_compile=True).")

#: the caveat of steps read after Grappler's automatic mixed precision was on
MIXED_PRECISION_REWRITE_CAVEAT = (
    "MIXED_PRECISION_REWRITE: private steps were read after Grappler's automatic mixed "
    "precision was on ({setting}). It rewrites float32 products and convolutions to a 16-bit "
    "type, outside the rounding bounds that keep every example's contribution within the "
    "clipping norm. tf_dp refuses to trace a step under it; this one was turned on after. "
    "Turn it off, and use a Keras dtype policy for mixed precision.")

#: the caveat of steps read after TensorFloat-32 was on with a GPU that uses it
TENSOR_FLOAT_32_CAVEAT = (
    "TENSOR_FLOAT_32: private steps were read after {setting} was on. It runs float32 "
    "products and convolutions with 10-bit mantissas, outside the rounding bounds that keep "
    "every example's contribution within the clipping norm. tf_dp refuses to trace or run a "
    "Keras step under it; this one was turned on after. Turn it off: "
    "tf.config.experimental.enable_tensor_float_32_execution(False).")

#: the caveat of steps read after sums were traced under XLA outside tf_dp's train step
XLA_CUSTOM_SUMS_CAVEAT = (
    "XLA_BATCH_SHAPES: {setting} (a custom loop under jit_compile=True), whose batch shapes "
    "tf_dp cannot know. XLA's CPU kernels round a row differently for different batch "
    "sizes, so one example could move an update by more than the clipping norm. Run custom "
    "loops outside XLA, or use fit().")

#: settings_on_since's kinds -> the caveat of the steps read after they were on
_SETTING_CAVEATS = {private_step.AUTO_CLUSTERING: XLA_AUTO_CLUSTERING_CAVEAT,
                    private_step.MIXED_PRECISION_REWRITE: MIXED_PRECISION_REWRITE_CAVEAT,
                    private_step.TENSOR_FLOAT_32: TENSOR_FLOAT_32_CAVEAT}


#: which budget drains each optimizer's step ledger (one budget per ledger: a ledger drained
#: by two budgets would split its steps between them).
_LEDGER_OWNERS = weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.RLock()

#: what epsilon never covers (docs/privacy.md).
NOT_COVERED = (
    "hyper-parameter search and any earlier runs on the same data",
    "data used outside training (preprocessing statistics, validation, metrics logged)",
    "what callbacks of your own decide from the logged metrics (computed without noise)",
    "side channels (timing, memory) and the model's architecture choice",
    "floating-point kernels that round an example's gradient differently for different "
    "batch sizes or row positions in batches padded to a multiple of 16 rows (none found "
    "for the layers swept on tf_dp's test CPU; a GPU's may): train at one batch shape to "
    "rule them out (fit(..., fixed_batch_shape=True), or a PoissonSampler with pad_to=...)",
    "batches whose other dimensions follow their examples (sequences padded to the batch's "
    "longest): one example then sets the shape every other is computed at; pad to a length "
    "fixed in advance",
)


def owner_of(optimizer):
    """The budget (in use) that drains ``optimizer``'s step ledger, or None."""
    ledger = getattr(optimizer, "_dp_ledger", None)
    if ledger is None:
        return None
    with _OWNERS_LOCK:
        ref = _LEDGER_OWNERS.get(ledger)
    owner = None if ref is None else ref()
    return None if owner is None else owner.current()


def costliest(mechanisms):
    """The costliest step among mechanisms of one optimizer (the same sigma and r): the one
    of the largest sampling rate q."""
    return max(mechanisms, key=lambda mechanism: mechanism[1])


def _sampling_assumption(caveats):
    if any(c.startswith("FIXED_BATCHES") for c in caveats):
        return ("fixed (shuffled) batches, accounted as if Poisson-sampled: outside the proven "
                "guarantee")
    if any(c.startswith("DECLARED_SAMPLING") for c in caveats):
        return "Poisson sampling declared by the user (sampling_probability=), not checked"
    return "Poisson sampling (each example independently with probability q)"


class PrivacyBudget:
    """The spent budget of one model (see the module docstring)."""

    def __init__(self, delta: float = 1e-5, target_epsilon: float = None):
        from tf_dp.accounting import PrivacyAccountant

        self.delta = delta
        self.target_epsilon = target_epsilon
        self.accountant = PrivacyAccountant()
        #: the JL steps accounted as exact clipping, for comparison only.
        self.exact_clipping_accountant = PrivacyAccountant()
        self.lineage = os.urandom(8).hex()
        #: the records this budget's history took over from other lineages when it adopted a
        #: saved budget (lineage -> that budget's config then): what it shares with them.
        self.forks: dict = {}
        self.caveats: set = set()
        #: ledger -> when this budget last read its steps (time.monotonic; before the first
        #: read, the ledger's creation)
        self._last_reads = weakref.WeakKeyDictionary()
        #: what happened to the record (e.g. a recovery from a budget journal), in order.
        self.notes: list = []
        #: the budget this one was taken into (two private models over the same variables
        #: share one budget: see ``absorb``); None while it is in use.
        self.merged_into = None
        # The step ledgers of every optimizer this budget has drained, replaced ones
        # included: a function traced before a compile() still applies steps through the
        # optimizer it captured, so those ledgers are drained for as long as the budget lives.
        self._ledgers: list = []

    def current(self) -> "PrivacyBudget":
        """The budget in use: this one, or the one it was taken into (``absorb``)."""
        budget = self
        while budget.merged_into is not None:
            budget = budget.merged_into
        return budget

    # -- spending ------------------------------------------------------------------------

    def drain(self, optimizer) -> None:
        """Moves the steps ``optimizer`` (and every optimizer this budget drained before, see
        ``track``) applied since the last drain into the accountants."""
        if optimizer is not None:
            self.track(optimizer)
        for ledger in list(self._ledgers):
            self._drain_ledger(ledger)

    def _drain_ledger(self, ledger) -> None:
        now = time.monotonic()
        try:
            self._drain_ledger_steps(ledger)
        finally:
            self._last_reads[ledger] = now

    def _drain_ledger_steps(self, ledger) -> None:
        drained = ledger.drain()
        for sigma, q, r, count in drained:
            self.accountant.step(noise_multiplier=sigma, sampling_probability=q,
                                 num_projections=r, count=count)
            self.caveats.update(ledger.caveats_of((sigma, q, r)))
            if private_step.sums_formed_under_xla(ledger.variables_of((sigma, q, r))):
                # Clipped sums of these variables traced under XLA outside tf_dp's step,
                # whatever function applied them and whenever it was traced (session 25
                # audit: an apply function traced in a warm-up step never saw the marking).
                self.caveats.add(XLA_CUSTOM_SUMS_CAVEAT.format(
                    setting=private_step.XLA_CUSTOM_SUMS_DETAIL))
            if r is not None:
                # What exact clipping would have cost at the same sigma, q and steps.
                self.exact_clipping_accountant.step(noise_multiplier=sigma,
                                                    sampling_probability=q, count=count)
        if drained:
            # Settings the step's own checks refuse while it is traced, on at some time
            # since this budget last read this ledger (turned on after the trace, which
            # still reaches it: session 24 audit, auto-clustering 12.3 C and 20.6 C; and off
            # again before the read, session 24 review, 7.31 C).
            since = self._last_reads.get(ledger, getattr(ledger, "created", 0.0))
            on = private_step.settings_on_since(since)
            for kind, caveat in _SETTING_CAVEATS.items():
                if kind in on:
                    self.caveats.add(caveat.format(setting=on[kind]))

    def track(self, optimizer) -> None:
        """From now on this budget drains ``optimizer``'s ledger, also after the optimizer
        is replaced (a traced function may still hold it). A ledger another budget drained
        until now is first drained into that budget (those steps were its model's)."""
        ledger = getattr(optimizer, "_dp_ledger", None)
        if ledger is None:
            return
        with _OWNERS_LOCK:
            if any(ledger is mine for mine in self._ledgers):
                return
            ref = _LEDGER_OWNERS.get(ledger)
            owner = None if ref is None else ref()
            owner = None if owner is None else owner.current()
            if owner is not None and owner is not self:
                owner._drain_ledger(ledger)
                owner._ledgers = [l for l in owner._ledgers if l is not ledger]
            self._ledgers.append(ledger)
            _LEDGER_OWNERS[ledger] = weakref.ref(self)

    def absorb(self, other: "PrivacyBudget", warning: str = None) -> "PrivacyBudget":
        """Takes ``other`` into this budget: both spent on the same variables (two private
        models sharing layers), so from now on they are one budget, whose record covers
        both (``merge``: the same history is not counted twice, different ones are
        composed) and which drains both budgets' optimizers. ``other`` forwards to this
        budget (``current``). Returns the budget in use."""
        me, other = self.current(), other.current()
        if other is me:
            return me
        with _OWNERS_LOCK:
            for budget in (me, other):  # both records complete before they are compared
                for ledger in list(budget._ledgers):
                    budget._drain_ledger(ledger)
            me.merge(other.get_config(), warning=warning)
            for ledger in other._ledgers:
                if not any(ledger is mine for mine in me._ledgers):
                    me._ledgers.append(ledger)
                _LEDGER_OWNERS[ledger] = weakref.ref(me)
            other._ledgers = []
            other.merged_into = me
        return me

    def _exact_counterpart(self):
        """Every step accounted so far as exact clipping would have cost it (JL steps with
        r dropped, exact steps as they are)."""
        from tf_dp.accounting import PrivacyAccountant

        acc = PrivacyAccountant()
        for p in self.accountant.phases:
            acc.step(noise_multiplier=p.noise_multiplier,
                     sampling_probability=p.sampling_probability, count=p.count)
        return acc

    def caveat(self, text: str) -> None:
        self.caveats.add(text)

    # -- reading ---------------------------------------------------------------------------

    def epsilon(self, delta: float = None, exact_clipping: bool = False) -> float:
        """Epsilon at ``delta`` (default: the budget's delta); with ``exact_clipping``, what
        all the steps would have cost with exact norms (the JL ones at the same sigma, q). When the accountant cannot reach its
        stated accuracy (very small JL r), its valid but looser upper bound, with a warning."""
        from tf_dp.accounting import AccuracyError

        delta = self.delta if delta is None else delta
        accountant = self._exact_counterpart() if exact_clipping else self.accountant
        try:
            return accountant.epsilon(delta)
        except AccuracyError as err:
            warnings.warn(f"tf_dp: epsilon could not be computed to the accountant's accuracy; "
                          f"reporting its upper bound {err.upper:g} ({err}).", stacklevel=3)
            return float(err.upper)

    def report(self, clipping: str = None) -> dict:
        """Epsilon, delta, steps and phases, the caveats, and whether the guarantee holds
        (False when a caveat voids the proof: see ``VOIDING`` and docs/privacy.md)."""
        caveats = sorted(self.caveats)
        report = {"epsilon": self.epsilon(), "delta": self.delta,
                  "steps": self.accountant.steps,
                  "phases": self.accountant.get_config()["phases"],
                  "caveats": caveats,
                  "guarantee_holds": not any(c.startswith(VOIDING) for c in caveats)}
        if self.exact_clipping_accountant.steps:
            report["epsilon_exact_clipping"] = self.epsilon(exact_clipping=True)
        report["rdp_epsilon"] = self._rdp_epsilon()
        report["unit_of_privacy"] = ("one training example (add/remove adjacency): each "
                                     "example's gradient clipped to l2_norm_clip per step")
        report["sampling"] = _sampling_assumption(caveats)
        report["not_covered"] = list(NOT_COVERED)
        if clipping is not None:
            report["clipping"] = clipping
        report["notes"] = list(self.notes)
        return report

    def _rdp_epsilon(self):
        """RDP's epsilon for comparison (Mironov et al. 2019); inf for JL or noiseless steps."""
        if not self.accountant.steps or any(p.noise_multiplier == 0
                                            for p in self.accountant.phases):
            return float("inf") if self.accountant.steps else 0.0
        try:
            return float(self.accountant.rdp_epsilon(self.delta))
        except (OverflowError, ValueError):
            return float("inf")

    def statement(self, clipping: str = None) -> str:
        """The report as text, in the spirit of TF Privacy's DP-SGD privacy statement."""
        r = self.report(clipping)
        lines = ["tf_dp privacy statement",
                 f"  unit of privacy: {r['unit_of_privacy']}",
                 f"  sampling: {r['sampling']}",
                 f"  steps: {r['steps']}"]
        if "clipping" in r:
            lines.insert(3, f"  clipping: {r['clipping']}")
        for p in r["phases"]:
            jl = "" if p.get("num_projections") is None else (
                f", JL norms r = {p['num_projections']}")
            lines.append(f"    {p['count']} steps at noise_multiplier {p['noise_multiplier']:g}, "
                         f"sampling_probability {p['sampling_probability']:g}{jl}")
        lines.append(f"  epsilon = {epsilon_text(r['epsilon'])} at delta = {r['delta']:g} "
                     "(f-DP numerical accountant, pessimistic)")
        lines.append(f"  for comparison, RDP epsilon = {epsilon_text(r['rdp_epsilon'])}")
        if "epsilon_exact_clipping" in r:
            lines.append("  the same steps with exact clipping: epsilon = "
                         f"{epsilon_text(r['epsilon_exact_clipping'])}")
        verdict = ("holds" if r["guarantee_holds"]
                   else "DOES NOT HOLD for this run (see the caveats)")
        lines.append(f"  the guarantee {verdict}")
        for caveat in r["caveats"]:
            lines.append(f"  caveat: {caveat}")
        for note in r["notes"]:
            lines.append(f"  note: {note}")
        lines.append("  not covered: " + "; ".join(r["not_covered"]))
        return "\n".join(lines)

    def remaining_steps(self, mechanism, boundaries=None, start=0):
        """Steps of ``mechanism`` (sigma, q, r) left within the target (None: no target).

        With ``boundaries``, ``mechanism`` is a list, one per phase of a batch-size schedule
        (``tf_dp.schedules.PiecewiseBatchSize``): the steps that the schedule's steps
        ``start, start + 1, ...`` can take (a second fit continues the schedule where the
        first stopped: costed from 0, its steps were those of the cheaper first phase,
        session 21 audit). ``start=None``: the start is not known (a dataset made by the
        user's sampler), so every step is costed at the costliest phase's mechanism.
        """
        if self.target_epsilon is None:
            return None
        if boundaries is not None:
            if start is None:
                return self.remaining_steps(costliest(mechanism))
            return self._remaining_scheduled(mechanism, list(boundaries), int(start))
        sigma, q, r = mechanism
        return max_additional_steps(self.accountant, self.target_epsilon, self.delta,
                                    dict(noise_multiplier=sigma, sampling_probability=q,
                                         num_projections=r))

    def _remaining_scheduled(self, mechanisms, boundaries, start=0, limit=10**8):
        from tf_dp.accounting.functions import largest_fitting
        from tf_dp.schedules import PiecewiseBatchSize

        schedule = PiecewiseBatchSize(boundaries, list(range(1, len(mechanisms) + 1)))

        def fits(m):
            acc = type(self.accountant).from_config(self.accountant.get_config())
            for size, count in schedule.phases(start + m, start=start):
                sigma, q, r = mechanisms[int(size) - 1]
                acc.step(noise_multiplier=sigma, sampling_probability=q, num_projections=r,
                         count=count)
            return acc.epsilon(self.delta) <= self.target_epsilon

        return largest_fitting(fits, limit)

    def no_budget_message(self, mechanism) -> str:
        """Why no step can be taken: one step is already too costly, or the budget is spent."""
        from tf_dp.accounting import PrivacyAccountant

        sigma, q, r = mechanism
        if self.accountant.steps == 0:
            one = PrivacyAccountant().step(noise_multiplier=sigma, sampling_probability=q,
                                           num_projections=r).epsilon(self.delta)
            return (f"tf_dp: cannot take even one step: a single step (sigma {sigma:g}, q "
                    f"{q:g}{'' if r is None else f', r {r}'}) already costs epsilon {epsilon_text(one)} "
                    f"at delta {self.delta:g}, above the target epsilon "
                    f"{self.target_epsilon:g}. Nothing was trained or spent; raise the noise "
                    "multiplier or lower the sampling rate.")
        return (f"tf_dp: the privacy budget (target epsilon {self.target_epsilon:g} at "
                f"delta {self.delta:g}) is spent: epsilon {epsilon_text(self.epsilon())} "
                f"after {self.accountant.steps} steps; not training.")

    # -- saving and restoring --------------------------------------------------------------

    def get_config(self) -> dict:
        return {"privacy_delta": self.delta, "target_epsilon": self.target_epsilon,
                "accountant": self.accountant.get_config(),
                "exact_clipping_accountant": self.exact_clipping_accountant.get_config(),
                "lineage": self.lineage, "forks": dict(self.forks),
                "caveats": sorted(self.caveats), "notes": list(self.notes)}

    @classmethod
    def from_config(cls, config: dict) -> "PrivacyBudget":
        from tf_dp.accounting import PrivacyAccountant

        budget = cls(config["privacy_delta"], config["target_epsilon"])
        budget.accountant = PrivacyAccountant.from_config(config["accountant"])
        budget.exact_clipping_accountant = PrivacyAccountant.from_config(
            config.get("exact_clipping_accountant") or {})
        budget.lineage = config.get("lineage") or budget.lineage
        budget.forks = dict(config.get("forks") or {})
        budget.caveats = set(config.get("caveats") or ())
        budget.notes = list(config.get("notes") or ())
        return budget

    def merge(self, saved: dict, warning: str = None) -> None:
        """Takes in a saved budget; nothing rewinds the spent budget.

        The record becomes this budget's plus the part of the saved one that is not shared
        history: the longest record both are known to share (same lineage: whichever is a
        prefix of the other; a lineage one of them adopted from, ``forks``: the record at
        that fork) is counted once. So an older checkpoint restored into a model that trained
        further adds nothing, a fresh model takes the file's record (and forks: a new lineage
        that remembers the file's), and a branch trained from a shared checkpoint brings only
        its own steps (session 22 audit: two branches of one checkpoint shared a lineage, and
        loading one into the other dropped 8 of its steps as "an older state of this run").
        Unrelated histories are composed whole, with a warning. Caveats are the union; delta
        and target are kept.
        """
        theirs = PrivacyBudget.from_config(saved)
        caveats = self.caveats | theirs.caveats
        if self.accountant.steps == 0 and self.exact_clipping_accountant.steps == 0:
            self._adopt(theirs)
        else:
            shared = self._shared_with(theirs)
            if shared is None:
                warnings.warn(warning or (
                    "tf_dp: loading weights trained in another run into a model that has "
                    "already trained: both runs' steps are now accounted."), stacklevel=4)
                shared = {"accountant": [], "exact_clipping_accountant": []}
            for acc, other, key in (
                    (self.accountant, theirs.accountant, "accountant"),
                    (self.exact_clipping_accountant, theirs.exact_clipping_accountant,
                     "exact_clipping_accountant")):
                for p in _minus(other.phases, shared[key]):
                    acc.step(noise_multiplier=p.noise_multiplier,
                             sampling_probability=p.sampling_probability,
                             num_projections=p.num_projections, count=p.count)
        self.caveats = caveats
        self.notes += [n for n in theirs.notes if n not in self.notes]

    def _adopt(self, theirs: "PrivacyBudget") -> None:
        """Takes ``theirs``'s record as this budget's, under a new lineage that remembers the
        one it forked from (its record then): two models restored from one file are two
        branches, whose later steps are not each other's."""
        self.accountant = theirs.accountant
        self.exact_clipping_accountant = theirs.exact_clipping_accountant
        self.forks = {**theirs.forks, theirs.lineage: _record(theirs)}
        self.lineage = os.urandom(8).hex()

    def forked(self) -> "PrivacyBudget":
        """This budget under a new lineage that remembers the current one (a model built
        from a saved config: another branch of the saved run)."""
        self.forks = {**self.forks, self.lineage: _record(self)}
        self.lineage = os.urandom(8).hex()
        return self

    def _shared_with(self, theirs: "PrivacyBudget"):
        """The longest record known to be the common history of this budget and ``theirs``
        ({"accountant": phases, "exact_clipping_accountant": phases}), or None."""
        mine = _record(self)
        other = _record(theirs)
        # Pairs of records on one line of history (a lineage, or the record a fork took
        # from it); what both sides share of that line is the SHORTER of the pair. A record
        # that merely looks like a prefix is no evidence: equal mechanisms are stored as one
        # block of steps, so another branch's later steps read as a prefix of ours (the
        # review of this change: 70 steps kept where 90 were spent).
        pairs = []
        if theirs.lineage == self.lineage:
            pairs.append((mine, other))
        if theirs.lineage in self.forks:
            pairs.append((self.forks[theirs.lineage], other))
        if self.lineage in theirs.forks:
            pairs.append((theirs.forks[self.lineage], mine))
        for lineage in set(self.forks) & set(theirs.forks):
            pairs.append((self.forks[lineage], theirs.forks[lineage]))
        best = None
        for a, b in pairs:
            a = {k: _phases_of(v) for k, v in a.items()}
            b = {k: _phases_of(v) for k, v in b.items()}
            if all(_is_prefix(a[k], b[k]) for k in a):
                shared = a
            elif all(_is_prefix(b[k], a[k]) for k in a):
                shared = b
            else:
                continue
            if all(_is_prefix(shared[k], _phases_of(mine[k])) and
                   _is_prefix(shared[k], _phases_of(other[k])) for k in shared):
                if best is None or _steps(shared["accountant"]) > _steps(best["accountant"]):
                    best = shared
        return best

    def adopt_journal(self, record: dict, path: str = "the budget journal"):
        """Takes in a budget journal (``tf_dp.keras.budget_journal``): its record as a saved
        budget (``merge``), then its in-flight steps, counted as spent unless this budget
        already went past the journal's record in this process (then the ledger knew whether
        they were applied). Returns the note added, if any."""
        base = record["budget"]
        self.merge(base)
        flight = record.get("in_flight")
        mine = self.accountant.get_config()["phases"]
        if not flight or mine != base["accountant"]["phases"]:
            return None
        count = int(flight["count"])
        sigma, q, r = (flight["noise_multiplier"], flight["sampling_probability"],
                       flight["num_projections"])
        self.accountant.step(noise_multiplier=sigma, sampling_probability=q,
                             num_projections=r, count=count)
        if r is not None:
            self.exact_clipping_accountant.step(noise_multiplier=sigma,
                                                sampling_probability=q, count=count)
        note = (f"resumed after an interruption: {path} recorded "
                f"{self.accountant.steps - count} steps spent and {count} step(s) under way "
                "when the process stopped; the budget covers all of them (a step under way "
                "may not have been applied: it is counted as spent), including any applied "
                "after the last backup, which the restart trains again with fresh noise.")
        self.notes.append(note)
        return note


def _record(budget: "PrivacyBudget") -> dict:
    return {"accountant": budget.accountant.get_config()["phases"],
            "exact_clipping_accountant": budget.exact_clipping_accountant.get_config()["phases"]}


def _phases_of(configs):
    from tf_dp.accounting import composition

    return [p if isinstance(p, composition.Phase) else composition.Phase(
        noise_multiplier=p["noise_multiplier"], sampling_probability=p["sampling_probability"],
        num_projections=p["num_projections"], count=p["count"]) for p in configs]


def _steps(phases) -> int:
    return sum(p.count for p in phases)


def _minus(longer, prefix):
    """The phases of ``longer`` after its beginning ``prefix`` (``_is_prefix``)."""
    prefix = _phases_of(prefix)
    longer = list(longer)
    if not prefix:
        return longer
    i = len(prefix) - 1
    extra = longer[i].count - prefix[i].count
    head = [dataclasses.replace(longer[i], count=extra)] if extra > 0 else []
    return head + longer[i + 1:]


def _is_prefix(shorter, longer):
    """True if the phases ``shorter`` are the beginning of ``longer``."""
    if len(shorter) > len(longer):
        return False
    if not shorter:
        return True
    same = lambda a, b: (a.noise_multiplier, a.sampling_probability, a.num_projections) == (
        b.noise_multiplier, b.sampling_probability, b.num_projections)
    for a, b in zip(shorter[:-1], longer):
        if not (same(a, b) and a.count == b.count):
            return False
    last, there = shorter[-1], longer[len(shorter) - 1]
    return same(last, there) and last.count <= there.count
