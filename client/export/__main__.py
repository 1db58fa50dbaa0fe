"""``python -m swap_state.client.export``: the same as ``swap-state export`` (whose arguments
and run :mod:`swap_state.client.cli` owns)."""

import sys

from swap_state.client.cli import main

sys.exit(main(["export", *sys.argv[1:]]))
