"""A private step is recorded exactly when its update can run.

The ledger's counter (``tf_dp.core.ledger``) was incremented in the graph with no order
against the update: a step whose data never came (the end of a dataset of unknown size)
was still recorded (fit reported 4 steps for 3 updates, session 24), and a step failing
after its update could leave the update unrecorded. Now the record waits for the step's
gradients and every write of the update, and the adaptive clip's noised count, waits for
the record.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: `tests` importable like under pytest / Bazel
    sys.path.insert(0, _ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tests import _reference as ref  # noqa: E402

_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def _model():
    keras.utils.set_random_seed(0)
    return tf_dp.keras.make_private(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))


def _compile(model, **kwargs):
    model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                         learning_rate=1e-2, **kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def test_the_end_of_a_dataset_of_unknown_size_records_no_step():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = rng.integers(0, 2, 48).astype("int32")
    ds = tf.data.Dataset.from_generator(
        lambda: zip(x, y), output_signature=(tf.TensorSpec([4], tf.float32),
                                             tf.TensorSpec([], tf.int32))).batch(16)
    assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model = _model()
    _compile(model)
    with pytest.warns(UserWarning):
        model.fit(ds, epochs=2, dataset_size=48, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert model.privacy_report()["steps"] == 6


def _writes_and_record(graph, variables, ledger):
    """The ops of ``graph`` writing ``variables``, and the op incrementing ``ledger``."""
    inner = {}
    for outer, placeholder in graph.captures:
        inner[id(outer)] = placeholder
    handles = {inner[id(v.handle)].name for v in variables if id(v.handle) in inner}
    assert len(handles) == len(variables)
    counts = inner[id(ledger._counts.handle)].name
    writes, records = [], []
    for op in graph.get_operations():
        if op.type not in _WRITES and not op.type.startswith("ResourceApply"):
            continue
        if op.inputs[0].name in handles:
            writes.append(op)
        elif op.inputs[0].name == counts:
            records.append(op)
    return writes, records


@pytest.mark.parametrize("adaptive", [False, True])
def test_every_write_of_the_update_waits_for_the_record(adaptive):
    model = _model()
    kwargs = {"adaptive_clipping": tf_dp.AdaptiveClipping(count_stddev=2.0)} if adaptive else {}
    _compile(model, **kwargs)
    opt = model.optimizer
    model.build((None, 4))
    opt.build(model.trainable_variables)
    watched = list(model.trainable_variables) + [opt.iterations]
    if adaptive:
        watched.append(opt._dp_clip_var)

    @tf.function(autograph=False)
    def step(sums):
        opt.apply_private(sums, model.trainable_variables, 8.0, sampling_probability=0.25,
                          clip_count=tf.constant(1.0) if adaptive else None)

    sums = [tf.ones(v.shape, tf.float64) for v in model.trainable_variables]
    graph = step.get_concrete_function(sums).graph
    writes, records = _writes_and_record(graph, watched, opt._dp_ledger)
    assert len(records) == 1
    written = set()
    for op in writes:
        assert records[0] in ref.ancestor_ops(op), op.name
        written.add(op.inputs[0].name)
    assert len(written) == len(watched)  # every weight, the step counter (and the clip)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
