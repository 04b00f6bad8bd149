"""`python -m gradserver.cli`: the `gradserver` command without its console script."""

import sys

from .main import main

sys.exit(main())
