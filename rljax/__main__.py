"""``python -m rljax ARGS``: the ``rljax`` command (``rljax.tools.cli.main``) with this interpreter."""

import sys

from rljax.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
