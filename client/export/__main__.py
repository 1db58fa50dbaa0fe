"""``python -m swap_state.client.export``: the same as ``swap-state export``."""

import sys

from swap_state.client.export.cli import main

sys.exit(main())
