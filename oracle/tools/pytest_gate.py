"""The pytest plugin of the baseline gate (registered by the repository's conftest.py).

Every run records its differential checks (oracle/tools/suite.py's recorder, on the
controller: with pytest-xdist the workers' reports come to it), writes them as an oracle
report to ``out/last-run-<kind>.json`` (and to ``--suite-report PATH`` when given), and
compares the cells it checked with ``reports/baseline/<kind>.json.gz`` (oracle/tools/baseline.py).
A cell that got worse by ``oracle diff``'s rules fails the run (exit status 1, with the
Markdown a reviewer pastes into a pull request); a cell without a baseline is listed, not
failed. ``--no-baseline-gate`` or ``ORACLE_BASELINE_GATE=off`` turns the comparison off
for experiments (the report is still written).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oracle.core.report import write_json
from oracle.tools import baseline
from oracle.tools.suite import SuiteRecorder

GATE_ENV = "ORACLE_BASELINE_GATE"


def pytest_addoption(parser):
    group = parser.getgroup("baseline gate")
    group.addoption("--suite-report", metavar="PATH",
                    help="also write the run's JSON report there (the differential checks as "
                         "an oracle report, every test's outcome and seconds)")
    group.addoption("--no-baseline-gate", action="store_true",
                    help=f"do not compare the differential cells with the committed baseline "
                         f"(also {GATE_ENV}=off)")
    group.addoption("--baseline", metavar="PATH",
                    help="the baseline to compare with (default reports/baseline/KIND.json.gz, "
                         "KIND: cpu, h100, h200... from the device)")
    group.addoption("--last-run", metavar="PATH",
                    help="where the run's report goes (default out/last-run-KIND.json; "
                         "`python -m oracle baseline accept` reads it)")


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # xdist workers send their reports to the controller
        return
    config.pluginmanager.register(BaselineGate(config), "baseline_gate")


class BaselineGate:
    """Records one session's checks; at its end writes the report and gates it."""

    def __init__(self, config):
        self.config = config
        self.recorder = SuiteRecorder()
        config.pluginmanager.register(self.recorder, "suite_recorder")
        self.text = ""

    def _paths(self) -> tuple[Path, Path]:
        kind = baseline.device_kind()
        opt = self.config.getoption
        return (Path(opt("last_run") or baseline.last_run_path(kind)),
                Path(opt("baseline") or baseline.baseline_path(kind)))

    def _enabled(self) -> bool:
        return not self.config.getoption("no_baseline_gate") and os.environ.get(
            GATE_ENV, "on").lower() not in ("0", "off", "false", "no")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.config.option.collectonly:
            return
        doc = self.recorder.report()
        extra = self.config.getoption("suite_report")
        written = [write_json(doc, extra)] if extra else []
        if not doc["cells"]:
            self.text = "\n".join(f"suite report: {p}" for p in written)
            return  # no differential check ran: nothing to record for a baseline, nor gate
        last, base = self._paths()
        written.append(write_json(doc, last))
        lines = [f"run report: {', '.join(str(p) for p in written)}"]
        if self._enabled():
            text, worse = baseline.gate(doc, base)
            lines.append(text)
            if worse:
                lines.append("Baseline gate FAILED: a differential cell got worse (above). "
                             "If intended, `python -m oracle baseline accept` after a full "
                             "run; --no-baseline-gate skips the gate.")
                if session.exitstatus == pytest.ExitCode.OK:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            lines.append("baseline gate off")
        self.text = "\n".join(lines)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.text:
            terminalreporter.write_sep("=", "baseline gate")
            terminalreporter.write_line(self.text)
