"""``python -m tiegrad``: the ``tiegrad`` command (what ``torchrun ... -m tiegrad`` runs)."""

import sys

from .cli import main

sys.exit(main())
