import sys

from hubsoup.cli import main

sys.exit(main())
