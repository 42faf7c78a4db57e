import sys

from kvstore.cli.main import main

sys.exit(main())
