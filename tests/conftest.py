"""Shared pytest setup for every test file; deliberately fixture-free.

Each test file must also run on its own (it is a Bazel ``py_test`` whose ``main`` is the file),
so nothing here may be needed by a test: this file only quiets TensorFlow and makes ``tf_dp``
importable from a plain checkout. Every test file ends with::

    if __name__ == "__main__":
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))
"""

import os
import sys

# Must be set before TensorFlow is first imported, which happens while collecting test files.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The repository root (this file's parent's parent), so `import tf_dp` works without an install
# and, under Bazel, resolves to the runfiles copy.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


# Under Bazel (which sets TEST_SRCDIR), scripts/test.sh runs each file with -m "not slow". A
# file whose tests are all marked slow then selects nothing, and pytest's exit code 5 would
# fail the target; count that case as a pass there. Outside Bazel, exit code 5 stays a failure.
_deselected = 0


def pytest_deselected(items):
    global _deselected
    _deselected += len(items)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 5 and _deselected and "TEST_SRCDIR" in os.environ:
        session.exitstatus = 0
