import sys

from sglang_hs.extract.cli import main

sys.exit(main())
