"""Print the fuzzer's counts (programs, rewrites fired, exclusions, seeds) at the end of the run.

Under pytest-xdist the fuzzer runs in a worker process: its lines travel to the controller, which
prints the summary, in xdist's ``workeroutput``.
"""

import pytest

from tests.fuzz import runner

#: JAX's own test files, run through hlopass by test_peer_tests.py, not as this project's tests.
collect_ignore = ["jax_peer"]

#: Lines received from xdist workers (in the controller).
_FROM_WORKERS: list[str] = []


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:   # an xdist worker
        workeroutput["hlopass_fuzz_summary"] = list(runner.SUMMARY_LINES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _FROM_WORKERS.extend(getattr(node, "workeroutput", {}).get("hlopass_fuzz_summary", []))


def pytest_terminal_summary(terminalreporter):
    lines = runner.SUMMARY_LINES + _FROM_WORKERS
    if lines:
        terminalreporter.write_sep("-", "differential fuzzer")
        for line in lines:
            terminalreporter.write_line(line)
