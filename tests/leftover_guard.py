"""The suite's guard against processes that outlive a test or the session (see tests/leftovers.py),
and the xdist grouping of tests that share a machine-wide service. A pytest plugin of its own,
loaded by tests/conftest.py, so that a probe suite can load it without the project's imports.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import leftovers

# Every process started from here on carries the session's id (see tests/leftovers.py).
os.environ[leftovers.SESSION_VAR] = SESSION_ID = leftovers.new_id()
KILLED_AFTER_TESTS: list[tuple[str, list[tuple[int, str]]]] = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    test_id = os.environ[leftovers.TEST_VAR] = leftovers.new_id()
    try:
        yield
    finally:
        del os.environ[leftovers.TEST_VAR]
        left = leftovers.left_behind(leftovers.TEST_VAR, test_id)
        if left:
            leftovers.kill_all(left)
            # Carried by the teardown report, so that an xdist controller lists it too.
            request.node.user_properties.append(("killed_leftovers", left))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, left in report.user_properties:
        if name == "killed_leftovers" and report.when == "teardown":
            KILLED_AFTER_TESTS.append((report.nodeid, left))


# With pytest-xdist (`make test` runs two workers), tests that share a machine-wide service or
# network state run on one worker, one at a time: the Ceph RGW and Slurm session fixtures (one
# instance each, not one per worker) and the network-namespace clusters (subnets, bridges).
_SERVICE_FIXTURES = {"s3_endpoint", "bucket", "remote_uri", "slurm_cluster"}


def _uses_netns_cluster(module: object) -> bool:
    names = (getattr(v, "__module__", None) or getattr(v, "__name__", "") for v in vars(module).values())
    return any(isinstance(n, str) and n.startswith("tests.cluster") for n in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses_service = _SERVICE_FIXTURES & set(getattr(item, "fixturenames", ()))
        module = getattr(item, "module", None)
        if uses_service or (module is not None and _uses_netns_cluster(module)):
            item.add_marker(pytest.mark.xdist_group("machine-services"))


def session_env() -> dict[str, str]:
    """The environment of a service the session shares (S3, Slurm): not tied to the test that happened
    to start it, so it is not killed after that test; the end-of-session check still covers it."""
    return {k: v for k, v in os.environ.items() if k != leftovers.TEST_VAR}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for nodeid, left in KILLED_AFTER_TESTS:
        listing = "; ".join(f"pid {pid}: {cmd}" for pid, cmd in left)
        terminalreporter.line(f"killed processes {nodeid} left running: {listing}")


LEFT_BY_WORKERS: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """An xdist worker's end-of-session finding, handed to the controller that decides the exit status."""
    listing = getattr(node, "workeroutput", {}).get("leftover_services")
    if listing:
        LEFT_BY_WORKERS.append(listing)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A service or job the suite started and never stopped fails the run, named. Under xdist each
    worker checks what it started (its own session id) and hands the list to the controller, whose
    own id only its workers carry."""
    config = session.config
    if config.pluginmanager.hasplugin("dsession"):  # the xdist controller
        listings = LEFT_BY_WORKERS
    else:
        left = leftovers.left_behind(leftovers.SESSION_VAR, SESSION_ID)
        leftovers.kill_all(left)
        listings = ["; ".join(f"pid {pid}: {cmd}" for pid, cmd in left)] if left else []
        if hasattr(config, "workeroutput"):  # an xdist worker
            if listings:
                config.workeroutput["leftover_services"] = listings[0]
            return
    if listings:
        config.get_terminal_writer().line(f"processes the suite started were still running: {'; '.join(listings)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
