"""Where a warning should point: the user's line, not the library frames between it and the warning."""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__))  # .../dilated_attention


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function that names the first frame outside
    this package, however many library frames lie between (``skip_file_prefixes`` needs Python 3.12)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level
