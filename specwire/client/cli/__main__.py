"""`python -m specwire.client.cli`: the `specwire` command."""

import sys

from specwire.client.cli import main

sys.exit(main())
