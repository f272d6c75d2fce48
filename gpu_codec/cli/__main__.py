"""``python -m gpu_codec.cli``: the same as the ``gpu-codec`` console script."""

import sys

from .commands import main

sys.exit(main())
