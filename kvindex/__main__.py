import sys

from kvindex.cli import main

sys.exit(main())
