import sys

from mtjax.cli import main

sys.exit(main())
