"""`python -m kvfence.tools.leakcheck` runs `kvfence leakcheck`."""

import sys

from kvfence.tools.leakcheck.cli import main

sys.exit(main())
