"""`python -m drafttrain.export RUN_DIR [--out DIR] ...` (`drafttrain.export.directory.main`)."""

import sys

from drafttrain.export.directory import main

sys.exit(main())
