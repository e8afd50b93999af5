"""No example, benchmark, script or doc hands a seed to a DP optimizer or sampler (issue 9 A1).

Every example used to pass ``seed=FLAGS.seed`` (default 0) to its DP optimizer, and the main
script ran one of them: anyone who knew the seed regenerated the noise of every step and
subtracted it from the released update. The examples' ``--seed`` now seeds initialisation
only. This scan keeps it that way: a DP optimizer or sampler call with a ``seed=`` argument,
or a ``seed`` key in a dict of DP optimizer arguments, fails the test with its location.
"""

import ast
import glob
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DP_CALLABLES = re.compile(r"^(DP[A-Za-z]*|PoissonSampler|make_private_optimizer)$")


def _sources():
    for pattern in ("examples/**/*.py", "bench/**/*.py", "scripts/**/*.py"):
        yield from glob.glob(os.path.join(ROOT, pattern), recursive=True)


def _call_name(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _seeded_dp_calls(tree):
    found = []
    dp_kwarg_dicts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and DP_CALLABLES.match(_call_name(node)):
            for kw in node.keywords:
                if kw.arg == "seed":
                    found.append(node.lineno)
                if kw.arg is None and isinstance(kw.value, ast.Name):
                    dp_kwarg_dicts.add(kw.value.id)  # DPSGD(**dp): check what dp holds
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in dp_kwarg_dicts
                                                for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and _call_name(value) == "dict":
                if any(kw.arg == "seed" for kw in value.keywords):
                    found.append(node.lineno)
            elif isinstance(value, ast.Dict):
                if any(isinstance(k, ast.Constant) and k.value == "seed" for k in value.keys):
                    found.append(node.lineno)
    return found


def test_no_example_or_benchmark_seeds_a_dp_optimizer_or_sampler():
    files = list(_sources())
    assert any(f.endswith("fashion_mnist.py") for f in files)  # the scan sees the examples
    offenders = []
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        offenders += [f"{os.path.relpath(path, ROOT)}:{line}" for line in _seeded_dp_calls(tree)]
    assert not offenders, ("a DP optimizer or sampler gets a seed (anyone holding it can remove "
                           f"the noise): {offenders}")


def test_the_scan_catches_the_patterns_it_looks_for():
    caught = _seeded_dp_calls(ast.parse(
        "opt = tf_dp.DPSGD(1.0, 1.0, seed=FLAGS.seed)\n"
        "dp = dict(l2_norm_clip=1.0, seed=0)\n"
        "opt2 = DPAdamJL(**dp)\n"
        "s = PoissonSampler(x, y, expected_batch_size=8, seed=3)\n"
        "keras.utils.set_random_seed(0)\n"))
    assert caught == [1, 4, 2] or sorted(caught) == [1, 2, 4]


def test_docs_pass_no_seed_to_a_dp_optimizer_or_sampler():
    pattern = re.compile(r"(DP[A-Za-z]*|PoissonSampler)\([^)]*seed\s*=")
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")]:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if pattern.search(line):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{i}")
    assert not offenders, offenders


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
