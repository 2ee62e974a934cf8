import sys

from kdflow.cli import main

sys.exit(main())
