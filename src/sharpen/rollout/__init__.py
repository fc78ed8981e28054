"""Rollout generation: inference engines, the episode loop, and weight sync into engines. Never imports trainer."""
