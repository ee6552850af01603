#!/usr/bin/env python
"""The same as ``python -m dilated_attention.tools.diagnose`` (installed: ``dilated-attention-diagnose``), from a checkout.

``--help`` says what it does."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dilated_attention.tools.diagnose import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
