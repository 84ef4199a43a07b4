"""``python -m dropless.plan``: the same as ``dropless-plan``."""

import sys

from dropless.plan.cli import main

sys.exit(main())
