"""`python -m collectives.cluster ...`: the hosts' command line (hosts.main)."""

from .hosts import main

raise SystemExit(main())
