import sys

from merger.cli import main

sys.exit(main())
