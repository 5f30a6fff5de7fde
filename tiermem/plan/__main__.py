"""``python -m tiermem.plan``: the ``tiermem plan`` command (:func:`tiermem.plan.cli.main`)."""

import sys

from tiermem.plan.cli import main

sys.exit(main())
