"""Layer 7: the `detdata` console command (and the demo with its tiny model)."""

from detdata.cli.main import main

__all__ = ["main"]
