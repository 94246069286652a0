"""``python -m tiegrad.cli``: the ``tiegrad`` command."""

import sys

from . import main

sys.exit(main())
