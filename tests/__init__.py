"""Test package. Hypothesis runs without per-example deadlines: the suite shares 2 cores."""

from hypothesis import settings

settings.register_profile("detdata", deadline=None, print_blob=True)
settings.load_profile("detdata")
