"""`python -m remat`: the `remat` command (remat.runtime.cli)."""
from remat.runtime.cli import main

raise SystemExit(main())
