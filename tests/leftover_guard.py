"""The suite's guard against processes that outlive a test or the session (see tests/leftovers.py),
and the xdist grouping of tests that share a machine-wide service. A pytest plugin of its own,
loaded by tests/conftest.py, so that a probe suite can load it without the project's imports.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests import leftovers, shared_standby

REPO = Path(__file__).resolve().parents[1]  # the tables below name modules relative to it

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
        left = leftovers.left_behind(leftovers.TEST_VAR, test_id) + shared_standby.leftovers_of_tests()
        if left:
            leftovers.kill_all(left)
            # Carried by the teardown report, so that an xdist controller lists it too.
            request.node.user_properties.append(("killed_leftovers", left))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, left in report.user_properties:
        if name == "killed_leftovers" and report.when == "teardown":
            KILLED_AFTER_TESTS.append((report.nodeid, left))


# With pytest-xdist (`make test` runs several workers), tests that share a machine-wide service run
# on one worker, one at a time, in a group per service: the Ceph RGW (one per worker would start a
# second gateway beside the first), the Slurm cluster, and the network-namespace clusters
# (multi-node jobs with timing assertions; their namespaces, links and subnets are named per
# worker, so the S3 group's one cluster test may run beside them). Different groups run side by
# side. The controller schedules without collecting, so the groups are a table of modules, which
# every worker checks against what each test uses (a test that starts using a service fails
# collection until its module is listed). Not xdist's own ``xdist_group`` mark: pytest-xdist
# 3.8 writes the group into an attribute pytest 9 no longer reads, so the mark groups nothing.
SERVICE_GROUPS = {
    "tests/test_slurm.py": "slurm",
    "tests/test_prepare_slurm.py": "slurm",
    "tests/test_s3_tier.py": "s3",
    "tests/test_s3_identity.py": "s3",
    "tests/test_signed_manifests.py": "s3",
    "tests/test_s3_gc_trust.py": "s3",
    "tests/test_chunked_digests.py": "s3",
    "tests/test_cluster_s3_throttle.py": "s3",
    "tests/test_soak_store.py": "s3",
    "tests/test_cluster_faults.py": "netns",
    "tests/test_cluster_firewall.py": "netns",
    "tests/test_cluster_memory_peer.py": "netns",
    "tests/test_cluster_netem.py": "netns",
    "tests/test_shared_storage.py": "netns",
    "tests/test_straggler_exclusion.py": "netns",
}
# Modules whose tests share a module-scoped process that costs seconds of CPU to start (a standby
# server imports torch, Megatron and NVRx): one work unit, so that one worker starts it, not each
# worker that got one of its tests. Products of jobs shared across modules are built once per run
# instead (tests/suite_cache.py).
MODULE_UNITS = {"tests/test_standby.py"}
_GROUP_FIXTURES = (("slurm", {"slurm_cluster"}), ("s3", {"s3_endpoint", "bucket", "remote_uri"}))


def _uses_netns_cluster(module: object) -> bool:
    return any(getattr(v, "__module__", None) == "tests.cluster.netns" for v in vars(module).values())


def service_group(item: pytest.Item) -> str | None:
    """The service a test shares with others, from what it uses."""
    fixtures = set(getattr(item, "fixturenames", ()))
    for group, names in _GROUP_FIXTURES:
        if fixtures & names:
            return group
    module = getattr(item, "module", None)
    return "netns" if module is not None and _uses_netns_cluster(module) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest first: xdist hands out work units in this order (service groups, the largest, go
    # first whatever it is), and a worker holds up to three tests ahead. With the multi-process
    # jobs (``slow``) at the end of the alphabet too, one worker ran its last jobs while the other
    # had finished: the last three minutes of a full run used the 2 cores at 30-75 %. Quick tests
    # last fill that tail instead. Stable: the collection order otherwise.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    missing = [m for m in sorted(MODULE_UNITS) if not (REPO / m).is_file()]  # not rootpath: other suites use it
    if missing:
        raise pytest.UsageError(f"MODULE_UNITS names {missing}, which are not test modules; fix: rename or remove them")
    for item in items:
        group = service_group(item)
        listed = SERVICE_GROUPS.get(item.nodeid.split("::", 1)[0])
        if group is not None and group != listed:
            raise pytest.UsageError(
                f"{item.nodeid} uses the {group} service, but its module is listed as {listed}; fix: set "
                f"its module's group to {group!r} in SERVICE_GROUPS (tests/leftover_guard.py)"
            )


class ServiceGroupScheduling(LoadScopeScheduling):
    """xdist's load scheduling, one test at a time, except that a service group's tests, and those
    of a module in ``MODULE_UNITS``, form one work unit (one worker runs them in turn)."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return SERVICE_GROUPS.get(module, module if module in MODULE_UNITS else nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ServiceGroupScheduling:
    return ServiceGroupScheduling(config, log)


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
    shared_standby.stop()  # a session service, not a leftover
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
