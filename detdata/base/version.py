"""The package version (one home: `detdata.__version__` and the build read it from here)."""

VERSION = "0.1.0"
