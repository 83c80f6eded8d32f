import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton kernels run in the interpreter when there is no GPU (must be set before triton is imported).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass
