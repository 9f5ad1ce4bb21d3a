import sys

from quasar.cli import main

sys.exit(main())
