import sys

from megasparse.cli import main

sys.exit(main())
