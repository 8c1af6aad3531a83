import sys

from kvmesh.cli import main

sys.exit(main())
