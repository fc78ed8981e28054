"""Test support code shared by several test modules (stand-in servers)."""
