"""``python -m cnrstore``: the ``cnrstore`` command (cnrstore/cli.py), for an environment whose scripts are not on
the PATH."""

import sys

from .cli import main

sys.exit(main())
