"""Layer 1: the exception tree and the small primitives every other layer shares.

Nothing here imports another detdata layer. The public surface is `detdata` itself;
modules in these folders are internal and may move.
"""
