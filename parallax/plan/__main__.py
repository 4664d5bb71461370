import sys

from parallax.plan.cli import main

sys.exit(main())
