import os
import zlib

# Every output buffer a launcher allocates starts as NaN, so an unwritten element fails.
os.environ["TRITONFORMER_POISON"] = "1"
# Workers share the GPU: their autotuning timings are contended, not for later processes to reuse.
os.environ["TRITONFORMER_KEEP_TUNING"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

from tritonformer import runtime  # noqa: E402

ON_GPU = not runtime.INTERPRET


@pytest.fixture
def device() -> str:
    return runtime.DEVICE


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test, stable per test id: fresh data, reproducible failures. (crc32,
    # not hash(): Python salts str hashes per process, which made the data change run to run.)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test plans its own launches: a test that forces a kernel variant (a monkeypatched
    threshold, which keys no plan) must not replay another test's plan of the same layout."""
    runtime.clear_plans()
    yield
    runtime.clear_plans()


gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (large shapes, compiled kernels)")
