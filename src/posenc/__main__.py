"""``python -m posenc``: the ``posenc`` command."""

import sys

from posenc.cli import main

sys.exit(main())
