import sys

from gemctl.cli import main

sys.exit(main())
