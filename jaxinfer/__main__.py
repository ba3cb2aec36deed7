"""``python -m jaxinfer ...``: the same as the ``jaxinfer`` command."""

import sys

from jaxinfer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
