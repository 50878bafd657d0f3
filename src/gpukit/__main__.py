"""``python -m gpukit`` runs the ``gpukit`` command."""

from gpukit.cli.main import main

raise SystemExit(main())
