"""Where a warning should point: the user's line, not the library frames between it and the warning."""

from __future__ import annotations

import os
import sys

import torch.nn.modules.module

_PACKAGE = os.path.dirname(os.path.abspath(__file__))  # .../dilated_attention
# ``nn.Module.__call__``'s frames between the user's ``layer(x)`` and the layer's ``forward``
_MODULE_CALL = os.path.abspath(torch.nn.modules.module.__file__)


def _passed_over(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE + os.sep) or path == _MODULE_CALL


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function that names the first frame outside this
    package and ``torch.nn.Module``'s call machinery (a layer of this package called as ``layer(x)`` points at
    that line), however many frames lie between (``skip_file_prefixes`` needs Python 3.12)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and _passed_over(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
