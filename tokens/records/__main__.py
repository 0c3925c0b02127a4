"""``python -m tokens.records URL VERB ...``: see ``tokens.records._cli``."""

import sys

from ._cli import main

sys.exit(main())
