"""The step ledger: every noisy update counted where the noise is added.

The accountant is a Python object, the private step runs in a graph. So the optimizer's
``apply_private`` adds one to a counter in the graph for every logical step it applies, in a
slot that stands for that step's mechanism (sigma, q, r), and the model's accountant drains
the counters on the host (after every batch of ``fit``, and whenever epsilon is read). Any
loop that reaches ``apply_private`` (``fit``, ``train_on_batch``, a custom loop over
``train_step`` or over ``apply_private`` itself) is therefore accounted; nothing depends on
``optimizer.iterations``, which restoring a checkpoint rewinds.

The counters are plain TensorFlow variables in a plain Python object: no checkpoint saves or
restores them (the spent budget itself is saved by the model, see ``tf_dp.keras``).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import List, Optional, Tuple

import tensorflow as tf

#: distinct mechanisms (sigma, q, r) one optimizer can record between two drains.
MAX_MECHANISMS = 256

Mechanism = Tuple[float, float, Optional[int]]


class StepLedger:
    """Counts applied private steps per mechanism (sigma, q, r)."""

    def __init__(self):
        #: when the ledger was made (time.monotonic): no step of it ran before
        self.created = time.monotonic()
        self._slots: List[Mechanism] = []
        #: slot -> caveats its steps carry (``note``), given to the budget that drains them
        self._notes = {}
        #: slot -> {id: weak reference} of the variables its steps update (``applies_to``)
        self._variables = {}
        self._lock = threading.Lock()
        with tf.init_scope():
            self._counts = tf.Variable(tf.zeros([MAX_MECHANISMS], tf.int64), trainable=False,
                                       name="tf_dp_step_ledger",
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def slot(self, mechanism: Mechanism) -> int:
        """The counter index of ``mechanism`` (assigned on first use, at trace time)."""
        with self._lock:
            if mechanism not in self._slots:
                if len(self._slots) >= MAX_MECHANISMS:
                    raise ValueError(f"tf_dp: more than {MAX_MECHANISMS} distinct (sigma, q, r) "
                                     "mechanisms for one optimizer.")
                self._slots.append(mechanism)
            return self._slots.index(mechanism)

    def note(self, mechanism: Mechanism, caveat: str) -> None:
        """The steps of ``mechanism`` carry ``caveat`` (trace time), besides any noted
        before: ``caveats_of`` hands them to the budget that drains steps of that
        mechanism."""
        slot = self.slot(mechanism)
        with self._lock:
            notes = self._notes.setdefault(slot, [])
            if caveat not in notes:
                notes.append(caveat)

    def applies_to(self, mechanism: Mechanism, variables) -> None:
        """The steps of ``mechanism`` update ``variables`` (trace time): a budget checks at
        every read what was done to them since (``variables_of``)."""
        slot = self.slot(mechanism)
        with self._lock:
            mine = self._variables.setdefault(slot, {})
            for v in variables:
                mine[id(v)] = weakref.ref(v)

    def variables_of(self, mechanism: Mechanism) -> list:
        """The live variables ``applies_to`` gave ``mechanism``'s steps."""
        with self._lock:
            if mechanism not in self._slots:
                return []
            refs = self._variables.get(self._slots.index(mechanism), {}).values()
            return [v for v in (ref() for ref in refs) if v is not None]

    def caveats_of(self, mechanism: Mechanism) -> Tuple[str, ...]:
        """The caveats ``note`` gave ``mechanism``'s steps (none: an empty tuple)."""
        with self._lock:
            if mechanism not in self._slots:
                return ()
            return tuple(self._notes.get(self._slots.index(mechanism), ()))

    def record(self, mechanism: Mechanism, count=1):
        """Graph op: adds ``count`` (a 0/1 tensor on non-first replicas) steps of ``mechanism``."""
        one_hot = tf.one_hot(self.slot(mechanism), MAX_MECHANISMS, dtype=tf.int64)
        return self._counts.assign_add(one_hot * tf.cast(count, tf.int64))

    def record_one_of(self, mechanisms, index, count=1):
        """Graph op: adds ``count`` steps of ``mechanisms[index]`` (``index`` a tensor: the
        phase of a batch-size schedule, known only in the graph; every candidate gets its
        slot at trace time)."""
        slots = tf.constant([self.slot(m) for m in mechanisms], tf.int32)
        one_hot = tf.one_hot(tf.gather(slots, index), MAX_MECHANISMS, dtype=tf.int64)
        return self._counts.assign_add(one_hot * tf.cast(count, tf.int64))

    def drain(self) -> List[Tuple[float, float, Optional[int], int]]:
        """Host side: the (sigma, q, r, count) recorded since the last drain, and resets.

        Subtracts exactly what it read, so steps recorded concurrently are not lost.
        """
        with self._lock:
            counts = self._counts.numpy()
            out = []
            for i, mech in enumerate(self._slots):
                if counts[i] > 0:
                    out.append((*mech, int(counts[i])))
            if out:
                self._counts.assign_sub(counts)
            return out

    def pending(self) -> int:
        return int(self._counts.numpy().sum())

    def __getstate__(self):
        raise TypeError("tf_dp: a StepLedger cannot be pickled (steps would be counted twice).")

    def __deepcopy__(self, memo):
        raise TypeError("tf_dp: a StepLedger cannot be copied (steps would be counted twice).")
