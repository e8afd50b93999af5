"""The test harness itself: every test file must also run as its own Bazel py_test."""

import os
import pathlib
import re
import sys

import pytest

# Under Bazel this file is a symlink in the runfiles tree; the real tests/ folder is beside
# its target, and holds the other test files (which are not in this target's runfiles).
_TESTS = pathlib.Path(os.path.realpath(__file__)).parent
# ... at the end: a test appended after the block still ran (pytest imports the whole file),
# but the layout hid it from a reader who stops at the standalone block.
_MAIN = re.compile(
    r"^if __name__ == [\"']__main__[\"']:\s*\n\s+sys\.exit\(pytest\.main\(\[__file__[^\n]*\)\)\s*\Z",
    re.M)


def _test_files():
    return sorted(p for p in _TESTS.rglob("*_test.py") if "__pycache__" not in p.parts)


def test_every_test_file_runs_itself():
    # tests/BUILD makes each file a py_test with main = the file: without this block the
    # target would import the file, run nothing and pass.
    missing = [str(p.relative_to(_TESTS)) for p in _test_files() if not _MAIN.search(p.read_text())]
    assert not missing, (
        "these test files lack the standalone block\n"
        '    if __name__ == "__main__":\n'
        "        sys.exit(pytest.main([__file__, *sys.argv[1:]]))\n"
        f"at their end: {missing}"
    )


def test_no_build_files_below_tests():
    # A BUILD file in a subfolder would make it its own package and hide its test files from
    # the glob in tests/BUILD.
    nested = [str(p.relative_to(_TESTS)) for p in _TESTS.rglob("BUILD*") if p.parent != _TESTS]
    assert not nested, f"remove these BUILD files (tests/BUILD covers all of tests/): {nested}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
