"""A pytest plugin of this suite (tests/conftest.py loads it): a test whose xdist worker died
runs once more, where pytest-rerunfailures is installed (requirements.txt pins it).

XLA:CPU's compile segfaulted a worker in about one full run in two, in no test in particular
(docs/development.md); a rerun keeps that from failing the run. Only a report reading "crashed
while running" is rerun: a test that fails its assertions still runs once. Without the plugin
(a peer environment that installs only benchmarks/requirements-peer.txt) nothing changes; a
command line's own ``--reruns`` wins.
"""

CRASHED = "crashed while running"


def pytest_configure(config):
    if config.pluginmanager.hasplugin("rerunfailures") and not config.getoption("reruns"):
        config.option.reruns = 1
        config.option.only_rerun = [CRASHED]
