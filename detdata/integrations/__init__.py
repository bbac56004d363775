"""Adapters and notes for training frameworks (Lightning, accelerate, torchtitan, OLMo-core).

This layer sits above `detdata.loading`; it imports nothing from `detdata.cli`.
"""
