"""Orchestration: the RL loop (`loop.py`) and the runtimes that build and wire components (`local.py`)."""
