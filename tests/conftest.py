"""Makes the shared test kits under tests/ importable (``snapshot_kit``, and the
``integration`` package it builds on) from every test folder and from the child processes
tests start with ``PYTHONPATH`` set to this folder."""

from __future__ import annotations

import pathlib
import sys

TESTS_DIR = pathlib.Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
