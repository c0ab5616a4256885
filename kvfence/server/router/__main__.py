"""`python -m kvfence.server.router`: the same as `kvfence router`."""

import sys

from kvfence.lifetime import die_with_parent_from_env
from kvfence.server.router.launch import main

die_with_parent_from_env()  # a child of `kvfence up` goes with it, even when it is SIGKILLed
sys.exit(main())
