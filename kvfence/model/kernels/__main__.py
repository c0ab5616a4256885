"""`python -m kvfence.model.kernels`: build the native kernels now (make does, once per venv).
Each builds in a process of its own, all at once: each is one g++ run of up to a minute, so on
two or more cores side by side beats one after another. `... kernels NAME` builds one."""

import logging
import subprocess
import sys

from kvfence.model.kernels import fused_epilogue, packed_gemm, paged_decode, paged_prefill

KERNELS = {
    "paged_decode": paged_decode,
    "paged_prefill": paged_prefill,
    "packed_gemm": packed_gemm,
    "fused_epilogue": fused_epilogue,
}

logging.basicConfig(level=logging.INFO)
if len(sys.argv) > 1:
    for name in sys.argv[1:]:
        ready = KERNELS[name]()
        print(f"native {name} kernel:", "ready" if ready else "unavailable (torch path)")
else:
    children = [
        subprocess.Popen([sys.executable, "-m", "kvfence.model.kernels", name]) for name in KERNELS
    ]
    sys.exit(max(c.wait() for c in children))
