"""``python -m tokenmill.bench serve|goodput ...``"""

import sys

from tokenmill.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
