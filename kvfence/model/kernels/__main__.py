"""`python -m kvfence.model.kernels`: build the native kernels now (make does, once per venv)."""

import logging

from kvfence.model.kernels import fused_epilogue, packed_gemm, paged_decode

logging.basicConfig(level=logging.INFO)
for what, ready in (
    ("paged decode", paged_decode()),
    ("packed gemm", packed_gemm()),
    ("fused epilogue", fused_epilogue()),
):
    print(f"native {what} kernel:", "ready" if ready else "unavailable (torch path)")
