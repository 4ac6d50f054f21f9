"""Every JUnit report names the bf16 path its run took (``scripts/test_times.py`` prints it
beside the times: a run is read against the machine it ran on)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _bf16_path_in_the_report(record_testsuite_property):
    from launch.compute import bf16_path

    record_testsuite_property("bf16_path", bf16_path())
