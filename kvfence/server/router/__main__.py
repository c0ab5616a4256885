"""`python -m kvfence.server.router`: the same as `kvfence router`."""

import sys

from kvfence.server.router.launch import main

sys.exit(main())
