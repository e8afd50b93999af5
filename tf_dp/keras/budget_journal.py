"""The budget journal: the spent budget written ahead of every step, so a crash loses none.

A checkpoint (``BackupAndRestore``, ``ModelCheckpoint``) saves the spent budget with the
weights, but only at its save points. When a process dies (SIGKILL, a lost machine) after
the last save, the steps applied since were already released (each noisy update left the
process: all-reduced to the other workers, written to logs, seen by whoever watches the
run), yet a restart from the backup would restore the older, smaller record and then spend
those steps again with fresh noise. The accountant must count both.

So before each execution of the train function, ``BudgetJournal`` durably writes (write to a
temporary file, fsync, atomic rename) the budget drained so far plus the steps about to be
applied ("in flight"). A restarted ``fit`` reads it before anything else: the model's budget
becomes at least the journal's record plus the in-flight steps, whose outcome is unknown and
which are therefore counted as spent (at most ``steps_per_execution`` steps too many, and
only when the process died between the write and the update). The run's privacy report
notes the recovery.

``fit`` keeps one journal in every ``keras.callbacks.BackupAndRestore`` directory by itself
(it goes when Keras deletes that directory at the end of a successful fit); add
``BudgetJournal(directory)`` to the callbacks for any other restart scheme (e.g. your own
``ModelCheckpoint`` plus ``load_weights``). Under ``MultiWorkerMirroredStrategy`` each worker
keeps its own journal file (``tf_dp_budget_journal.worker<i>.json``); every worker's ledger
records every step, so each journal is the run's.

Loops that do not go through ``fit`` (``train_on_batch``, custom loops) are not journaled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import keras

from tf_dp import _internals

_LOG = logging.getLogger("tf_dp")

FORMAT = "tf_dp budget journal 1"
_NAME = re.compile(r"^tf_dp_budget_journal(\.worker(\d+))?\.json$")


class BudgetJournal(keras.callbacks.Callback):
    """Writes the spent budget ahead of every step into ``directory`` (see the module
    docstring); ``fit`` adopts an existing journal before it starts.

    Args:
      directory: where the journal lives (the ``backup_dir`` of a ``BackupAndRestore``, or
        any directory that survives the process).
      durable: fsync every write (default True): the record then survives the machine, not
        only the process. False keeps it in the OS cache (survives a killed process only).
    """

    def __init__(self, directory, durable: bool = True):
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"`directory` must be a non-empty path, got {directory!r}.")
        self.directory = os.fspath(directory)
        self.durable = bool(durable)
        self._in_flight = None   # the mechanism (sigma, q, r) of this fit's steps
        self._worker = None      # this worker's index under a multi-worker strategy

    # -- paths ---------------------------------------------------------------------------

    def _set_worker(self, model):
        strategy = model.distribute_strategy
        if _internals.in_multi_worker_mode(strategy):
            self._worker = _internals.worker_input_context(strategy).input_pipeline_id
        else:
            self._worker = None

    @property
    def path(self) -> str:
        name = ("tf_dp_budget_journal.json" if self._worker is None
                else f"tf_dp_budget_journal.worker{self._worker}.json")
        return os.path.join(self.directory, name)

    def _check_not_shared(self):
        """Refuses a directory that another worker (or a one-process run) also journals in:
        two writers would overwrite each other's record, and Keras' BackupAndRestore, which
        has no multi-worker logic, each other's weights."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            match = _NAME.match(name)
            if not match:
                continue
            other = None if match.group(2) is None else int(match.group(2))
            if other != self._worker:
                raise ValueError(
                    f"The backup directory {self.directory!r} (`backup_dir` / `directory`) is "
                    f"shared: it holds the budget journal {name!r} of another "
                    f"{'worker' if other is not None else 'one-process run'}. Give each "
                    "worker its own directory (Keras 3's BackupAndRestore writes the same "
                    "files from every worker).")

    # -- called by fit -------------------------------------------------------------------

    def recover(self, model) -> bool:
        """Adopts the journal in ``directory``, if any, into ``model``'s budget (before fit
        computes what it may spend). Returns True if there was one."""
        self._set_worker(model)
        self._check_not_shared()
        if not os.path.exists(self.path):
            return False
        with open(self.path) as f:
            try:
                record = json.load(f)
            except json.JSONDecodeError as err:
                # The rename is atomic, so a torn file means it was not written by us.
                raise ValueError(f"The budget journal {self.path!r} is not valid JSON ({err}); "
                                 "refusing to guess how much budget was spent.") from None
        if record.get("format") != FORMAT:
            raise ValueError(f"{self.path!r} is not a tf_dp budget journal "
                             f"(format {record.get('format')!r}).")
        note = model._dp_budget_obj().adopt_journal(record, self.path)
        if note:
            _LOG.warning("tf_dp: %s", note)
        return True

    def arm(self, mechanism):
        """The mechanism (sigma, q, r) of the steps this fit applies: what is written as in
        flight (for a batch-size schedule, the costliest phase's)."""
        self._in_flight = tuple(mechanism)

    def write(self, in_flight_steps: int = 0):
        """Durably writes the drained budget and ``in_flight_steps`` steps about to run."""
        budget = self.model.privacy_budget  # drains the ledger first
        record = {"format": FORMAT, "budget": budget.get_config(), "in_flight": None}
        if in_flight_steps and self._in_flight is not None:
            sigma, q, r = self._in_flight
            record["in_flight"] = {"noise_multiplier": sigma, "sampling_probability": q,
                                   "num_projections": r, "count": int(in_flight_steps)}
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def settle(self):
        """After fit (also after an exception): the ledger is authoritative in this process,
        so the journal, if its directory still exists, gets the drained budget and nothing in
        flight."""
        if self.model is not None and os.path.exists(self.path):
            self.write(0)

    # -- callback hooks ------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._set_worker(self.model)
        self._check_not_shared()
        if self._worker is not None:
            _check_workers_restored_the_same_state(self.model)
        self.write(0)

    def on_train_batch_begin(self, batch, logs=None):
        self.write(int(getattr(self.model, "steps_per_execution", 1) or 1))

    def on_epoch_end(self, epoch, logs=None):
        self._check_not_shared()


def journals_for(callbacks):
    """The journals ``fit`` keeps: the user's ``BudgetJournal``s and one per
    ``BackupAndRestore`` directory not already journaled."""
    journals = [cb for cb in callbacks if isinstance(cb, BudgetJournal)]
    have = {os.path.abspath(j.directory) for j in journals}
    for cb in callbacks:
        if isinstance(cb, keras.callbacks.BackupAndRestore):
            directory = os.fspath(cb.backup_dir)
            if os.path.abspath(directory) not in have:
                have.add(os.path.abspath(directory))
                journals.append(BudgetJournal(directory))
    return journals


def _check_workers_restored_the_same_state(model):
    """Under a multi-worker strategy, every worker must hold the same weights and optimizer
    state after restoring (each restores its own backup; one killed between two workers'
    saves leaves them one save apart, and mirrored training would silently diverge)."""
    digest = hashlib.sha256()
    variables = list(model.weights) + list(getattr(model.optimizer, "variables", []))
    for v in variables:
        digest.update(keras.ops.convert_to_numpy(v).tobytes())
    fingerprint = int.from_bytes(digest.digest()[:7], "big")  # fits an int64
    from tf_dp.keras.dp_model import _max_and_min_over_workers  # (imports this module)

    largest, smallest = _max_and_min_over_workers(model.distribute_strategy, fingerprint)
    if largest != smallest:
        raise RuntimeError(
            "tf_dp: the workers restored different training states (their backups were saved "
            "at different steps: a worker died between two workers' saves). Restore every "
            "worker from the same step (e.g. BackupAndRestore(double_checkpoint=True) and "
            "remove the newer backup) before training on.")
