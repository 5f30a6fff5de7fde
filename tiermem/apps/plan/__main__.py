"""``python -m tiermem.apps.plan``: the ``tiermem plan`` command
(:func:`tiermem.apps.plan.cli.main`)."""

import sys

from tiermem.apps.plan.cli import main

sys.exit(main())
