import sys

from tritonkit_client.cli import main

sys.exit(main())
