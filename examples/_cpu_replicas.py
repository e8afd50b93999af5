"""Several replicas per CPU worker under MultiWorkerMirroredStrategy, to emulate workers with
several accelerators on a CPU-only machine (examples/multi_worker.py --local_replicas, and
the multi-worker tests).

TensorFlow gives each CPU worker of a MultiWorkerMirroredStrategy exactly one device,
whatever logical devices the process has: ``CollectiveAllReduceExtended.
_initialize_local_devices`` (tensorflow/python/distribute/collective_all_reduce_strategy.py)
counts GPUs and TPUs only and otherwise returns ("CPU", 1). A worker with n GPUs gets n
replicas. ``use_cpu_replicas(n)`` splits the CPU into n logical devices and makes that private
method return them, so a CPU worker gets n replicas too. tf_dp's own code does not depend on
it: it only reads how many replicas each worker has.

This touches a private TensorFlow method (checked on TF 2.21) and is for tests and
demonstrations only; it refuses to run when that method is not there.
"""

import tensorflow as tf


def use_cpu_replicas(n: int) -> None:
    """n >= 1 replicas per CPU worker for every MultiWorkerMirroredStrategy made after this
    call (which must come before TensorFlow initialises its devices)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be an integer >= 1, got {n!r}.")
    if n == 1:
        return
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    extended = cars.CollectiveAllReduceExtended
    original = getattr(extended, "_initialize_local_devices", None)
    if original is None:
        raise RuntimeError("This TensorFlow has no CollectiveAllReduceExtended."
                           "_initialize_local_devices: cannot give CPU workers several "
                           "replicas.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])

    def local_devices(self, cluster_resolver, worker_device):
        devices, device_type = original(self, cluster_resolver, worker_device)
        if device_type == "CPU":
            devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(n))
        return devices, device_type

    extended._initialize_local_devices = local_devices
