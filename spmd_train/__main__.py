"""`python -m spmd_train` is the same as the `spmd-train` command."""

import sys

from spmd_train.cli.main import main

sys.exit(main())
