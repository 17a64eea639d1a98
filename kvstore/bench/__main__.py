import sys

from kvstore.bench import main

sys.exit(main())
