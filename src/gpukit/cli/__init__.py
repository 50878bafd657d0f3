"""The ``gpukit`` command: argument parsing and rendering only, one module per command."""
