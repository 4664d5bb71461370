import sys

from parallax.train.cli import main

sys.exit(main())
