"""``python -m ckptshim`` is the ``ckptshim`` command."""

import sys

from ckptshim.cli import main

sys.exit(main())
