"""``python -m swap_state.server``: the same as the ``swap-state-server`` command."""

import sys

from swap_state.server.cli import main

__all__: list[str] = []

sys.exit(main())
