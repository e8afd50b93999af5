"""A process killed mid-epoch and the job restarted from BackupAndRestore: training resumes,
the spent budget covers every step the dead process applied (also those after its last
backup), no noise is replayed, and the report says what happened.

The processes (tests/keras/_fault_child.py) train a zero-loss model, so each update is the
step's noise alone; BackupAndRestore saves every 3 steps; the victim SIGKILLs itself right
after step 8, so the backup holds step 6 and steps 7 and 8 were applied and released after
it. Without the budget journal the restart would account 6 of the 8 steps.

The budget-journal unit tests (in one process, no kill) are at the end.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.keras import _multi_worker_data as data
from tf_dp.keras import BudgetJournal, make_private
from tf_dp.keras.budget import PrivacyBudget
from tf_dp.keras.budget_journal import FORMAT
from tf_dp.optimizers import DPSGD
from tf_dp.data.poisson import exact_rate

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_KILL_AT, _BACKUP_AT, _EPOCH = 8, 6, 10
_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=_ROOT,
            TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")


def _free_ports(n):
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(socket.create_server(("localhost", 0)))
                   for _ in range(n)]
        return [server.getsockname()[1] for server in servers]


def _start(index, ports, root, kill_at, attempt):
    return subprocess.Popen(
        [sys.executable, os.path.join(_HERE, "_fault_child.py"), str(index), ports,
         str(root / "backup"), str(kill_at), attempt, str(root)],
        env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=600):
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return logs


def _crash_and_restart(root, workers):
    """First attempt: the last worker kills itself after step 8; the others are killed as
    soon as it is dead (a job scheduler restarting the whole job). Then every worker starts
    again on the same backup directories."""
    ports = "-" if workers == 1 else ",".join(map(str, _free_ports(workers)))
    procs = [_start(i, ports, root, _KILL_AT if i == workers - 1 else 0, "first")
             for i in range(workers)]
    victim = procs[-1]
    logs = _wait([victim])
    assert victim.returncode == -9, logs[0][-3000:]
    time.sleep(1.0)  # let the survivors reach (and block in) the next step
    for p in procs[:-1]:
        p.kill()
    _wait(procs[:-1])
    if workers > 1:
        ports = ",".join(map(str, _free_ports(workers)))
    procs = [_start(i, ports, root, 0, "restart") for i in range(workers)]
    logs = _wait(procs)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return logs


def _weights(root, index, attempt, step):
    return np.load(root / f"w{index}_{attempt}_{step}.npy")


def _check_recovery(root, index, log):
    result = json.loads((root / f"r{index}_restart.json").read_text())
    # Training resumed from the last backup (step 6, its weights) ...
    assert result["start"]["iterations"] == _BACKUP_AT
    np.testing.assert_array_equal(_weights(root, index, "restart", "start"),
                                  _weights(root, index, "first", _BACKUP_AT))
    # ... with a budget that covers the 8 steps applied before the kill, not the backup's 6
    # (a survivor may have journaled one more step as under way: counted as spent).
    assert _KILL_AT <= result["start"]["steps"] <= _KILL_AT + 1
    assert result["steps"] == result["start"]["steps"] + _EPOCH
    assert result["iterations"] == _BACKUP_AT + _EPOCH
    # No noise replayed: the restart's updates from step 6 on are fresh draws, not the
    # first attempt's updates 7 and 8 (which the zero loss makes pure noise).
    for step in (7, 8):
        first = _weights(root, index, "first", step) - _weights(root, index, "first", step - 1)
        again = (_weights(root, index, "restart", step)
                 - _weights(root, index, "restart", step - 1 if step > 7 else "start"))
        assert np.abs(first).max() > 0 and np.abs(again).max() > 0
        assert not np.allclose(first, again)
        # and each is one noise draw of the right size: sigma C / (q N) per coordinate
        q = 4 / 40
        assert again.std() == pytest.approx(data.SIGMA * data.CLIP / (q * 40), rel=0.25)
    # The report says what happened.
    assert len(result["notes"]) == 1 and "resumed after an interruption" in result["notes"][0]
    assert "resumed after an interruption" in log
    return result


def test_a_killed_process_restarted_from_backup_keeps_every_applied_step(tmp_path):
    logs = _crash_and_restart(tmp_path, workers=1)
    result = _check_recovery(tmp_path, 0, logs[0])
    assert result["start"]["steps"] == _KILL_AT  # the victim's own journal: exact
    assert not (tmp_path / "backup" / "worker0").exists()  # Keras removed it after success


def test_a_killed_worker_and_the_restarted_cluster_keep_every_applied_step(tmp_path):
    """Two MultiWorkerMirroredStrategy workers; worker 1 is SIGKILLed after step 8, worker 0
    (blocked in the next all-reduce) is killed by the 'scheduler'; both restart from their
    own backups. Each worker's budget covers the 8 applied steps; their weights agree."""
    logs = _crash_and_restart(tmp_path, workers=2)
    results = [_check_recovery(tmp_path, i, log) for i, log in enumerate(logs)]
    assert results[1]["start"]["steps"] == _KILL_AT
    for step in ("start", 7, _BACKUP_AT + _EPOCH):
        np.testing.assert_array_equal(_weights(tmp_path, 0, "restart", step),
                                      _weights(tmp_path, 1, "restart", step))


# ------------------------------------------------------------------ the journal, in process


def _model():
    model = make_private(data.linear())
    model.compile(optimizer=DPSGD(data.CLIP, data.SIGMA, learning_rate=0.1),
                  loss=data.zero_loss)
    return model


def _xy(n=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 30)).astype("float32"), np.zeros((n, 20), np.float32)


class _Snapshot(keras.callbacks.Callback):
    """Copies the journal file as it is while each step runs (what a kill would leave)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.seen = path, []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(json.loads(open(self.path).read()))


def test_the_journal_is_written_before_every_step_with_the_step_in_flight(tmp_path):
    model = _model()
    journal = BudgetJournal(tmp_path)
    snap = _Snapshot(journal.path)
    x, y = _xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[journal, snap])
    assert len(snap.seen) == 10
    for step, record in enumerate(snap.seen):
        assert record["format"] == FORMAT
        spent = sum(p["count"] for p in record["budget"]["accountant"]["phases"])
        assert spent == step  # drained before the step
        assert record["in_flight"] == {"noise_multiplier": data.SIGMA,
                                       "sampling_probability": exact_rate(0.1),
                                       "num_projections": None,
                                       "count": 1}
    # after fit: settled, the whole record and nothing in flight
    final = json.loads(open(journal.path).read())
    assert final["in_flight"] is None
    assert sum(p["count"] for p in final["budget"]["accountant"]["phases"]) == 10


def test_steps_per_execution_puts_every_step_of_the_execution_in_flight(tmp_path):
    model = make_private(data.linear())
    model.compile(optimizer=DPSGD(data.CLIP, data.SIGMA, learning_rate=0.1),
                  loss=data.zero_loss, steps_per_execution=5)
    journal = BudgetJournal(tmp_path)
    snap = _Snapshot(journal.path)
    x, y = _xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[journal, snap])
    assert [r["in_flight"]["count"] for r in snap.seen] == [5, 5]


def test_a_fresh_model_adopts_a_journal_and_counts_the_step_in_flight(tmp_path):
    """What a restart after a kill sees: the journal as the killed process left it."""
    model = _model()
    journal = BudgetJournal(tmp_path)
    snap = _Snapshot(journal.path)
    x, y = _xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[journal, snap],
              steps_per_epoch=4)
    left = snap.seen[2]  # killed during step 3: 2 drained, 1 in flight
    journal_file = tmp_path / "killed" / "tf_dp_budget_journal.json"
    journal_file.parent.mkdir()
    journal_file.write_text(json.dumps(left))
    fresh = _model()
    fresh.fit(x, y, batch_size=4, epochs=1, verbose=0, steps_per_epoch=2,
              callbacks=[BudgetJournal(journal_file.parent)])
    assert fresh.accountant.steps == 3 + 2
    # A branch of the killed run (session 22): a lineage of its own that remembers the
    # journal's, so that the killed run's other files count as shared history.
    assert model.privacy_budget.lineage in fresh.privacy_budget.forks
    assert any("resumed after an interruption" in n for n in fresh.privacy_report()["notes"])
    assert "note: resumed after an interruption" in fresh.privacy_statement()


def test_a_model_that_trained_past_the_journal_does_not_count_its_flight_twice(tmp_path):
    """An exception inside fit: the ledger in this process knows what was applied; the
    settled journal has nothing in flight and re-adopting it changes nothing."""

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("boom")

    model = _model()
    x, y = _xy()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[BudgetJournal(tmp_path), Boom()])
    assert model.accountant.steps == 3
    record = json.loads((tmp_path / "tf_dp_budget_journal.json").read_text())
    assert record["in_flight"] is None
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, steps_per_epoch=2,
              callbacks=[BudgetJournal(tmp_path)])
    assert model.accountant.steps == 5
    assert model.privacy_report()["notes"] == []


def test_target_epsilon_sees_the_journal_before_fit_plans_its_steps(tmp_path):
    """A restart whose journal already spent the target must not train: fit adopts the
    journal before it computes the steps left (the backup's weights, restored later by
    BackupAndRestore, would come too late)."""
    model = _model()
    x, y = _xy()
    journal = BudgetJournal(tmp_path)
    model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[journal])
    spent = model.epsilon()
    fresh = make_private(data.linear(), target_epsilon=spent * 0.99)
    fresh.compile(optimizer=DPSGD(data.CLIP, data.SIGMA, learning_rate=0.1),
                  loss=data.zero_loss)
    with pytest.warns(UserWarning, match="is spent"):
        history = fresh.fit(x, y, batch_size=4, epochs=1, verbose=0,
                            callbacks=[BudgetJournal(tmp_path)])
    assert fresh.accountant.steps == 30 and not history.history.get("loss")


def test_adopting_never_lowers_the_budget():
    budget = PrivacyBudget()
    budget.accountant.step(noise_multiplier=1.0, sampling_probability=0.1, count=20)
    older = budget.get_config()
    older["accountant"] = dict(older["accountant"],
                               phases=[dict(older["accountant"]["phases"][0], count=5)])
    record = {"format": FORMAT, "budget": older,
              "in_flight": {"noise_multiplier": 1.0, "sampling_probability": 0.1,
                            "num_projections": None, "count": 1}}
    assert budget.adopt_journal(record) is None
    assert budget.accountant.steps == 20


def test_backup_and_restore_gets_a_journal_by_itself(tmp_path):
    model = _model()
    journal = tmp_path / "backup" / "tf_dp_budget_journal.json"
    snap = _Snapshot(str(journal))
    x, y = _xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, steps_per_epoch=3,
              callbacks=[keras.callbacks.BackupAndRestore(tmp_path / "backup",
                                                          delete_checkpoint=False), snap])
    assert [r["in_flight"]["count"] for r in snap.seen] == [1, 1, 1]
    assert json.loads(journal.read_text())["in_flight"] is None


def test_workers_that_restored_different_states_are_refused(monkeypatch):
    """Each worker restores its own backup; one killed between two workers' saves leaves
    them a save apart. The check compares a hash of every weight and optimizer variable over
    the workers (here the all-gather is replaced: the two-process test runs the real one)."""
    from tf_dp.keras import budget_journal, dp_model

    model = _model()
    x, y = _xy()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, steps_per_epoch=1)
    seen = []

    def gather(strategy, value):
        seen.append(value)
        return value + len(seen) - 1, value  # the first call: all equal; then: not

    monkeypatch.setattr(dp_model, "_max_and_min_over_workers", gather)
    budget_journal._check_workers_restored_the_same_state(model)
    with pytest.raises(RuntimeError, match="restored different training states"):
        budget_journal._check_workers_restored_the_same_state(model)
    assert seen[0] == seen[1]  # the same state hashes alike
    model.set_weights([w + 1.0 for w in model.get_weights()])
    with pytest.raises(RuntimeError):
        budget_journal._check_workers_restored_the_same_state(model)
    assert seen[2] != seen[0]  # and a different one does not


def test_a_shared_or_broken_journal_directory_is_refused(tmp_path):
    x, y = _xy()
    (tmp_path / "tf_dp_budget_journal.worker1.json").write_text("{}")
    with pytest.raises(ValueError, match="`backup_dir` / `directory`.*shared"):
        _model().fit(x, y, batch_size=4, verbose=0, callbacks=[BudgetJournal(tmp_path)])
    broken = tmp_path / "b"
    broken.mkdir()
    (broken / "tf_dp_budget_journal.json").write_text('{"format": "tf_dp budget')
    with pytest.raises(ValueError, match="not valid JSON"):
        _model().fit(x, y, batch_size=4, verbose=0, callbacks=[BudgetJournal(broken)])
    with pytest.raises(ValueError, match="`directory`"):
        BudgetJournal("")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
