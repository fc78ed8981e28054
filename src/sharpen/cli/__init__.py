"""The `sharpen` command line. Parses and validates config first; heavy modules are imported lazily."""
