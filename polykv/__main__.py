import sys

from polykv.cli import main

sys.exit(main())
