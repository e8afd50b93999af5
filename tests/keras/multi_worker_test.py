"""Private training under tf.distribute.MultiWorkerMirroredStrategy: two worker processes.

Privacy across workers: each example is sampled with probability q once per step over the
whole cluster (each worker samples only its own shard, rows w, w + W, ...), the clipped sums
are all-reduced, the noise N(0, sigma^2 C^2) is added once per global step (by the first
replica of the cluster), the sum is divided by the global expected batch q * N, and every
worker's accountant records each step once.

The two-process tests start two workers on localhost ports (tests/keras/_multi_worker_child.py)
and compare their weights with a one-process run and with the noise worked out by hand, once
with one replica per worker and once with two (logical CPUs standing for a worker's
accelerators, examples/_cpu_replicas.py): each worker's sample is then split over its own
replicas.
"""

import contextlib
import json
import math
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.keras import _multi_worker_data as data
from tf_dp.core import gaussian_noise
from tf_dp.core.randomness import seeded_draw
from tf_dp.data import PoissonSampler
from tf_dp.keras import dp_model, make_private

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _free_ports(n):
    with contextlib.ExitStack() as stack:  # all held at once: n distinct ports
        servers = [stack.enter_context(socket.create_server(("localhost", 0)))
                   for _ in range(n)]
        return [server.getsockname()[1] for server in servers]


def _run_workers(tmp_path, workers=2, local_replicas=1):
    ports = ",".join(str(p) for p in _free_ports(workers))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=_ROOT,
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    procs, outs = [], []
    for i in range(workers):
        out = tmp_path / f"worker{i}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(_HERE, "_multi_worker_child.py"), str(i), ports,
             str(out), str(local_replicas)], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module", params=[1, 2], ids=["1_replica_per_worker",
                                                    "2_replicas_per_worker"])
def cluster(request, tmp_path_factory):
    """Every problem's results from each of two workers (one cluster start per number of
    replicas per worker). Two replicas per worker stand for workers with two accelerators:
    logical CPUs (examples/_cpu_replicas.py), so each worker's sample is split over its own
    two replicas, 4 in the cluster."""
    results = _run_workers(tmp_path_factory.mktemp("workers"), local_replicas=request.param)
    for worker in results:
        assert worker["num_replicas_in_sync"] == 2 * request.param
    return results


def _replicas_per_worker(cluster):
    return cluster[0]["num_replicas_in_sync"] // len(cluster)


@pytest.mark.filterwarnings("ignore:tf_dp. DPSGD has `noise_multiplier=0`")
@pytest.mark.filterwarnings("ignore:ε = inf")
def test_two_workers_give_the_weights_of_one_process(cluster):
    """Each worker holds its shard's rows of the same logical batches; sigma = 0 and clipping
    active: the cluster must compute exactly the one-process update (sum over both shards,
    divided by the global q N), and each worker's accountant holds every step once."""
    if _replicas_per_worker(cluster) > 1:
        pytest.skip("a distributed dataset is refused with 2 replicas per worker (tested "
                    "below); `test_full_batches_...` compares the weights there")
    results = [worker["declared"] for worker in cluster]
    x, y = data.regression()
    model = make_private(data.mlp())
    model.compile(optimizer=data.optimizer(), loss="mse")
    ragged = tf.ragged.constant([b.tolist() for b in data.batches()], dtype=tf.int64)
    whole = tf.data.Dataset.from_tensor_slices(ragged).map(
        lambda idx: (tf.gather(x, idx), tf.gather(y, idx)))
    model.fit(whole, epochs=1, steps_per_epoch=data.STEPS, verbose=0, dataset_size=data.N,
              sampling_probability=data.Q)
    moved = max(float(np.max(np.abs(a - b)))
                for a, b in zip(model.get_weights(), data.mlp().get_weights()))
    assert moved > 1e-3
    for result in results:
        assert result["iterations"] == data.STEPS
        assert result["phases"] == [[0.0, data.Q, data.STEPS]]  # once per step, every worker
        for got, want in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5, atol=1e-6)


def test_a_distributed_dataset_is_refused_with_two_replicas_per_worker(cluster):
    """Each of a worker's replicas takes its own element of a step: tf_dp cannot tell one
    sample split over them from one sample each (q times 2, accounted as q)."""
    if _replicas_per_worker(cluster) == 1:
        pytest.skip("accepted with one replica per worker (the test above)")
    for worker in cluster:
        assert "needs one replica per worker; this cluster has 2" in (
            worker["declared_refused"]["error"] or "")


@pytest.mark.filterwarnings("ignore:tf_dp. DPSGD has `noise_multiplier=0`")
@pytest.mark.filterwarnings("ignore:ε = inf")
def test_full_batches_give_the_weights_of_one_process(cluster):
    """Arrays sampled by fit at q = 1 (every row in every step), sigma = 0, clipping active:
    however each worker's shard is split over its replicas, the cluster computes the
    one-process update, and each worker accounts every step once at q = 1."""
    x, y = data.regression()
    model = make_private(data.mlp())
    model.compile(optimizer=data.optimizer(), loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=data.FULL_STEPS, verbose=0)
    for worker in cluster:
        result = worker["full"]
        assert result["iterations"] == data.FULL_STEPS
        assert result["phases"] == [[0.0, 1.0, data.FULL_STEPS]]
        for got, want in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["full_accum", "full_physical"])
def test_accumulation_adaptive_clipping_and_physical_batches_give_one_process(cluster, mode):
    """The q = 1 problem with gradient accumulation and adaptive clipping (the count of
    unclipped examples summed over every replica of the cluster, so C moves as in one
    process), or with physical batches of at most 3 rows: with 1 and 2 replicas per worker
    the weights, C and the accounting are one process's."""
    x, y = data.regression()
    opt_kwargs, fit_kwargs = data.full_variant(mode)
    model = make_private(data.mlp())
    model.compile(optimizer=data.optimizer(**opt_kwargs), loss="mse")
    model.fit(x, y, epochs=data.FULL_STEPS, verbose=0, **fit_kwargs)
    clip = float(model.optimizer.current_clip())
    if mode == "full_accum":
        assert clip != 0.3  # C moved
    for worker in cluster:
        result = worker[mode]
        assert result["iterations"] == data.FULL_STEPS
        assert [p[1:] for p in result["phases"]] == [[1.0, data.FULL_STEPS]]
        assert result["clip"] == pytest.approx(clip, rel=1e-9)
        for got, want in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5, atol=1e-6)


def test_noise_is_added_once_for_the_cluster_and_divided_by_the_global_batch(cluster):
    """Zero loss, seeded noise (test only): after one step both workers hold exactly
    -z / (q N), z the step's noise draw. Noise from each worker would double it (the seeded
    streams agree), a per-worker divisor q N_w would double it too."""
    results = [worker["noise"] for worker in cluster]
    model = data.linear()
    noise = gaussian_noise([(w.shape, tf.float64) for w in model.trainable_variables],
                           data.SIGMA * data.CLIP, seeded_draw(data.SEED, "noise", 0))
    q = data.NOISE_BATCH / data.NOISE_N
    want = [-z.numpy() / (q * data.NOISE_N) for z in noise]
    for result in results:
        assert result["iterations"] == 1
        assert result["phases"] == [[data.SIGMA, q, 1]]
        for got, w in zip(result["weights"], want):
            np.testing.assert_allclose(np.asarray(got, np.float32), w, rtol=1e-5, atol=1e-7)
    std = np.concatenate([np.ravel(r) for r in results[0]["weights"]]).std()
    assert std == pytest.approx(data.SIGMA * data.CLIP / (q * data.NOISE_N), rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("local_replicas", [1, 2])
def test_the_multi_worker_example_runs_two_local_workers(tmp_path, local_replicas):
    """examples/multi_worker.py --workers=2 --smoke: the launcher starts two workers, they
    train together and the chief reports epsilon and accuracy (with --local_replicas=2, on
    4 replicas)."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(_ROOT, "examples", "multi_worker.py"), "--workers=2",
         "--smoke", f"--result={out}", f"--local_replicas={local_replicas}"],
        capture_output=True, text=True, timeout=900,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=_ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["workers"] == 2 and result["steps"] == 8
    assert result["replicas"] == 2 * local_replicas
    assert 0 < result["epsilon"] < 10 and result["test_accuracy"] > 0.1
    assert f"2 workers ({2 * local_replicas} replicas), 8 steps" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("local_replicas", [1, 2])
def test_the_multi_worker_example_recovers_from_a_killed_worker(tmp_path, local_replicas):
    """--simulate_fault_at=5 --save_every=3: worker 1 SIGKILLs itself after step 5; the
    launcher restarts the job, which resumes from step 3's backup; the chief's budget covers
    the 5 applied steps (plus at most the one it had in flight) and the 8 of the new epoch,
    and it prints the recovery note."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(_ROOT, "examples", "multi_worker.py"), "--workers=2",
         "--smoke", f"--result={out}", f"--backup_dir={tmp_path / 'backup'}",
         "--save_every=3", "--simulate_fault_at=5", "--max_restarts=1",
         f"--local_replicas={local_replicas}"],
        capture_output=True, text=True, timeout=1200,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=_ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 3 + 8  # resumed from the backup at step 3
    assert 5 + 8 <= result["budget_steps"] <= 6 + 8
    assert "restarting the job" in proc.stdout
    assert "note: resumed after an interruption" in proc.stdout


# ------------------------------------------------------------------ in one process


class _FakeStrategy:
    """What the shard sampler asks of the strategy: the row counts of every worker."""

    def __init__(self, counts):
        self.counts = counts


def test_each_worker_samples_only_its_shard_at_q(monkeypatch):
    """Two workers' shard samplers: disjoint rows (w, w + 2, ...), every row of the data set
    drawn with probability q per step (binomial bounds), so the union is one Poisson sample
    of the whole data set at q, not two."""
    n, batch, steps = 60, 12, 600
    q = batch / n
    monkeypatch.setattr(dp_model, "_max_and_min_over_workers", lambda strategy, rows: (n, n))
    counts = np.zeros(n)
    for worker in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker,
                                             num_replicas_in_sync=2)
        sampler = dp_model._worker_shard_sampler(None, context, np.arange(n), None, None,
                                                 batch, seed=None)
        assert sampler.sampling_probability == pytest.approx(q)
        assert sampler.steps_per_epoch == round(1 / q)
        mine = np.zeros(n)
        for element in sampler.dataset(steps):
            rows = element[0].numpy() if isinstance(element, tuple) else element.numpy()
            np.add.at(mine, rows, 1)
        assert not mine[np.arange(n) % 2 != worker].any()  # only its own shard
        counts += mine
    # Every row: Binomial(steps, q); 5-sigma bounds, all rows (union of both workers).
    sd = math.sqrt(steps * q * (1 - q))
    assert np.all(np.abs(counts - steps * q) < 5 * sd), (counts.min(), counts.max())


def test_seeded_workers_do_not_draw_the_same_coins(monkeypatch):
    """A seeded (debugging) run: the workers' shard samplers get different streams. With one
    seed for all they kept the same positions of their shards in every step."""
    n = 60
    monkeypatch.setattr(dp_model, "_max_and_min_over_workers", lambda strategy, rows: (n, n))
    positions = []
    for worker in range(2):
        context = tf.distribute.InputContext(2, worker, 2)
        sampler = dp_model._worker_shard_sampler(None, context, np.arange(n), None, None, 12,
                                                 seed=5)
        positions.append([sorted(((e[0] if isinstance(e, tuple) else e).numpy() - worker)
                                 // 2) for e in sampler.dataset(6)])
    assert positions[0] != positions[1]


def test_workers_with_different_row_counts_are_refused(monkeypatch):
    monkeypatch.setattr(dp_model, "_max_and_min_over_workers", lambda strategy, rows: (60, 58))
    context = tf.distribute.InputContext(2, 0, 2)
    with pytest.raises(ValueError, match="same arrays.*between 58 and 60 rows"):
        dp_model._worker_shard_sampler(None, context, np.arange(60), None, None, 12, seed=None)


def test_a_batch_size_schedule_divides_and_accounts_each_step_by_its_phase(cluster):
    """Zero loss, seeded noise (test only), a schedule of q = 1/4 then 1/2 over the whole
    data set (each worker samples its shard at those rates): after the steps both workers
    hold exactly -sum_t z_t / (q_t N), and their accountants hold each phase at its own q
    once."""
    results = [worker["schedule"] for worker in cluster]
    model = data.linear()
    shapes = [(w.shape, tf.float64) for w in model.trainable_variables]
    qs = [data.SCHEDULE(t) / data.NOISE_N for t in range(data.SCHEDULE_STEPS)]
    want = [np.zeros(s, np.float32) for s, _ in shapes]
    for t, q in enumerate(qs):
        z = gaussian_noise(shapes, data.SIGMA * data.CLIP, seeded_draw(data.SEED, "noise", t))
        want = [w - zi.numpy() / (q * data.NOISE_N) for w, zi in zip(want, z)]
    for result in results:
        assert result["iterations"] == data.SCHEDULE_STEPS
        assert result["phases"] == [[data.SIGMA, 0.25, 1], [data.SIGMA, 0.5, 2]]
        for got, w in zip(result["weights"], want):
            np.testing.assert_allclose(np.asarray(got, np.float32), w, rtol=1e-5, atol=1e-7)


def test_validation_metrics_are_those_of_the_whole_held_out_set_on_every_worker(cluster):
    """validation_split under MultiWorkerMirroredStrategy: each worker evaluates all of the
    held-out rows (the same batches on every replica), so the last epoch's val_loss and
    val_mae are the final weights' on those rows, on both workers; the held-out rows are
    never sampled for training (N = 30 in the accountant's q = 8 / 30)."""
    results = [worker["validation"] for worker in cluster]
    x, y = data.regression()
    cut = int(len(x) * 0.75)
    for result in results:
        model = data.mlp()
        model.set_weights([np.asarray(w, np.float32) for w in result["weights"]])
        pred = model.predict(x[cut:], verbose=0)
        history = result["history"]
        assert len(history["val_loss"]) == 2
        assert history["val_loss"][-1] == pytest.approx(float(np.mean((pred - y[cut:]) ** 2)),
                                                        rel=1e-5)
        assert history["val_mae"][-1] == pytest.approx(float(np.mean(np.abs(pred - y[cut:]))),
                                                       rel=1e-5)
        (sigma, q, steps), = result["phases"]
        assert q == pytest.approx(8 / cut)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unsafe_multi_worker_inputs_are_refused():
    two = tf.distribute.InputContext(2, 0, 2)
    check = dp_model._check_multi_worker_input
    x = np.zeros((20, 3), np.float32)
    ok = dict(poisson_sampling=True, schedule=None, validation_split=0.0,
              validation_data=None, dataset_size=None, sampling_probability=None)
    check(two, x, **ok)  # arrays: fit shards and samples them
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(4)
    with pytest.raises(ValueError, match="same examples independently on each worker"):
        check(two, dataset, **{**ok, "dataset_size": 20})
    with pytest.raises(ValueError, match="same examples independently"):
        check(two, PoissonSampler(x, expected_batch_size=4), **ok)
    with pytest.raises(ValueError, match="poisson_sampling=False"):
        check(two, x, **{**ok, "poisson_sampling": False})
    check(tf.distribute.InputContext(2, 0, 4), x, **ok)  # 2 replicas per worker: split
    with pytest.raises(ValueError, match="same number of replicas on every worker"):
        check(tf.distribute.InputContext(2, 0, 3), x, **ok)
    # A distributed dataset with 2 replicas per worker: one sample split or two samples? The
    # same with one replica per worker (and dataset_size, q) is accepted (the cluster tests).
    distributed_x = type("DistributedDatasetsFromFunction", (), {"_input_contexts": []})()
    declared = {**ok, "dataset_size": 40, "sampling_probability": 0.25}
    check(two, distributed_x, **declared)
    with pytest.raises(ValueError, match="needs one replica per worker; this cluster has 2"):
        check(tf.distribute.InputContext(2, 0, 4), distributed_x, **declared)
    check(two, x, **{**ok, "schedule": object()})  # each worker's shard at the phases' q
    check(two, x, **{**ok, "validation_split": 0.2})  # every worker evaluates all of it
    check(two, x, **{**ok, "validation_data": (x, x)})
    distributed = tf.distribute.MirroredStrategy(["/cpu:0"]).experimental_distribute_dataset(
        dataset)
    with pytest.raises(ValueError, match="validation_data. must be arrays"):
        check(two, x, **{**ok, "validation_data": distributed})



def test_a_workers_sample_is_split_over_its_local_replicas():
    """Two replicas per worker: each logical batch of the worker becomes two consecutive
    elements (rows j, j + 2, ... for local replica j; an empty part included), the
    distributed input hands them to the worker's two replicas for one step; a schedule's
    phase goes unchanged with every part."""
    batches = [np.arange(5), np.arange(10, 11), np.arange(20, 20)]
    ds = tf.data.Dataset.from_generator(lambda: ((b, b * 2) for b in batches),
                                        output_signature=(tf.TensorSpec([None], tf.int64),) * 2)
    parts = [tuple(t.numpy().tolist() for t in e)
             for e in dp_model._split_over_local_replicas(ds, 2)]
    assert parts == [([0, 2, 4], [0, 4, 8]), ([1, 3], [2, 6]), ([10], [20]), ([], []),
                     ([], []), ([], [])]
    phased = tf.data.Dataset.from_tensor_slices(tf.range(6)).batch(3).map(
        lambda b: ((b,), tf.size(b)))
    parts = [(e[0][0].numpy().tolist(), int(e[1]))
             for e in dp_model._split_over_local_replicas(phased, 2, with_phase=True)]
    assert parts == [([0, 2], 3), ([1], 3), ([3, 5], 3), ([4], 3)]
    assert dp_model._split_over_local_replicas(ds, 1) is ds

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
