"""``python -m detdata.cli ...`` (and ``torchrun ... -m detdata.cli ...``): the `detdata` command.

The module to run is this package's ``__main__``, not ``detdata.cli.main``: running a module that
its own package already imported makes runpy warn (``RuntimeWarning: 'detdata.cli.main' found in
sys.modules``) on every rank.
"""

import sys

from detdata.cli.main import main

sys.exit(main())
