"""Typed configuration (pydantic schemas) and recipe loading. Imports no torch, vllm or ray."""

from sharpen.config.loader import ConfigError, dump_config, load_config
from sharpen.config.schema import SharpenConfig

__all__ = ["ConfigError", "SharpenConfig", "dump_config", "load_config"]
