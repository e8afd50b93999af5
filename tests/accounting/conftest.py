"""Registers the `slow` marker for the accounting tests (default suite: -m "not slow")."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running accuracy checks (minutes)")
