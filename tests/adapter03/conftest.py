"""The torchtitan 0.3 adapter's tests: run in the 0.3 venv (.venv-titan03), where torchtitan 0.3
is importable, by tests/integration/test_titan03_adapter_suite.py; in the main venv (torchtitan
0.2) nothing here is collected."""

from __future__ import annotations

from swap_state.client.torchtitan.version import torchtitan_line

collect_ignore_glob = [] if torchtitan_line() == "0.3" else ["test_*.py"]
