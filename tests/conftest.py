"""Suite-wide settings.

Without a GPU, Triton kernels (the engine's CUDA path) run in Triton's interpreter on CPU
tensors. The interpreter must be chosen before anything imports triton - transformers and
torch may import it while the suite runs - so it is set here, once, for the session.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
