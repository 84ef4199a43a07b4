"""``python -m dropless.convert`` = ``dropless-convert`` (:mod:`dropless.convert.cli`)."""

import sys

from dropless.convert.cli import main

sys.exit(main())
