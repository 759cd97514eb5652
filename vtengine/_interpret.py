"""Select Triton's CPU interpreter on hosts without CUDA. Imported first by both packages (vtengine, campaigns):
TRITON_INTERPRET is read when triton is first imported, and other libraries (transformers, torch._dynamo) may
import triton before our kernels do."""
import os


def select() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


select()
