"""`python -m adapters.cli ...`: the console script without installing it.

Tests and benches start servers and workers this way, so they run the code of
the tree they are in (mutants: the patched copy) whatever is installed.
"""

from __future__ import annotations

import sys

from adapters.cli.main import main

sys.exit(main())
