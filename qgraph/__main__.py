"""``python -m qgraph ...`` (and ``torchrun -m qgraph capture ...``): the ``qgraph`` command."""
import sys

from .cli import main

sys.exit(main())
