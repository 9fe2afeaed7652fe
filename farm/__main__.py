"""Entry point for ``python -m farm``."""

from farm.cli import main

raise SystemExit(main())
