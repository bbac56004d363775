"""``python -m detdata.cli ...`` (and ``torchrun ... -m detdata.cli ...``): the `detdata` command.

Run this, not ``-m detdata.cli.main``: runpy warns on every rank about a module that its own
package already imported (``RuntimeWarning: 'detdata.cli.main' found in sys.modules``).
"""

import sys

from detdata.cli.main import main

sys.exit(main())
