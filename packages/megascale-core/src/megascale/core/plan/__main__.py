"""``python -m megascale.core.plan``: the ``megascale plan`` command without Lightning."""

from megascale.core.plan.cli import main

raise SystemExit(main())
