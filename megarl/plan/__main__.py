import sys

from megarl.plan import main

sys.exit(main())
