"""`python -m ecshare.config`: print, write or check the config reference (docs/CONFIG.md).

Only an entry point; the work is `ecshare.config.reference.main`.
"""

import sys

from ecshare.config.reference import main

if __name__ == "__main__":
    sys.exit(main())
