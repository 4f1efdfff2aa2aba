"""The ``hook`` marker: ``@pytest.mark.hook("register_models")`` names the hook a test covers;
tests/plugins/test_hooks_documented.py requires one such test per hook."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "hook(name): the test covers this plugin hook (see PLUGINS.md)")
