"""`python -m megarl ...` is the `megarl` command."""
import sys

from megarl.cli import main

sys.exit(main())
