"""Stub package (see torchvision/__init__.py)."""
