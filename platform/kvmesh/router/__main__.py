import sys

from kvmesh.router.server import main

sys.exit(main())
