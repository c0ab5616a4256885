"""`python -m kvfence.model.kernels`: build the native kernels now (make does, once per venv)."""

import logging

from kvfence.model.kernels import paged_decode

logging.basicConfig(level=logging.INFO)
print("native paged decode kernel:", "ready" if paged_decode() else "unavailable (torch path)")
