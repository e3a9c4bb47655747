"""Test-session setup. Triton kernels run under the Triton interpreter on machines without a GPU; the
variable must be set before anything imports triton, hence at the very top of the root conftest."""

import os
import sys

if os.environ.get("NIBBLE_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers picks fla-core at import time when importable; on a CPU fla's Triton kernels cannot run,
# so the reference side of the tests uses transformers' torch fallback.
if os.environ.get("NIBBLE_TEST_GPU") != "1":
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
