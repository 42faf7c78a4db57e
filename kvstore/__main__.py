"""`python -m kvstore`: the `kvstore` command (as `python -m kvstore.cli`)."""
import sys

from kvstore.cli.main import main

sys.exit(main())
