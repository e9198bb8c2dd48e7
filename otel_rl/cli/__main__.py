"""``python -m otel_rl.cli``: the ``otel-rl`` command."""

import sys

from otel_rl.cli.main import main

sys.exit(main())
