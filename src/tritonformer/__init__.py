"""tritonformer: Triton kernels for Transformers, forward and backward."""

from . import runtime
from .ops.add import add
from .ops.matmul import matmul
from .ops.softmax import softmax

__version__ = "0.1.0"
__all__ = ["add", "matmul", "softmax", "runtime", "__version__"]
