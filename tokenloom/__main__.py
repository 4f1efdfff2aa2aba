"""``python -m tokenloom ...`` is the ``tokenloom`` command."""

import sys

from tokenloom.api.cli import main

sys.exit(main())
