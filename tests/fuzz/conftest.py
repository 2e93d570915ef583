"""Print the fuzzer's counts (programs, rewrites fired, exclusions, seeds) at the end of the run."""

from tests.fuzz import runner

#: JAX's own test files, run through hlopass by test_peer_tests.py, not as this project's tests.
collect_ignore = ["jax_peer"]


def pytest_terminal_summary(terminalreporter):
    if runner.SUMMARY_LINES:
        terminalreporter.write_sep("-", "differential fuzzer")
        for line in runner.SUMMARY_LINES:
            terminalreporter.write_line(line)
