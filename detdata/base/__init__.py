"""Layer 1: the exception tree and the small primitives every other layer shares; imports no
other detdata layer. Modules here are internal and may move (the public surface is `detdata`).
"""
