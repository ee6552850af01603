"""Without CUDA the fused kernel runs in Triton's interpreter. Triton decides at its import whether its
own library functions (``tl.sum``, ``tl.zeros``, ...) are interpreted, and importing the library may
import Triton (through torch's compile machinery), so the variable is set before any test module loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
