"""Environments: what the policy interacts with. Today only the single-turn case exists, and it lives in the
episode loop (`rollout/episodes.py`: prompt -> one completion -> reward). The multi-turn `Environment`
protocol, tools and the sandbox arrive with the agentic-environments issue."""
