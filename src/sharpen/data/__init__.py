"""Task data: sources that load `Example`s, the seeded sampler that orders them, and chat rendering to tokens."""

from sharpen.data.chat import render_continuation, render_prompt
from sharpen.data.sampler import ExampleSampler
from sharpen.data.sources import DEFAULT_SYSTEM_PROMPT, DataError, load_examples, to_json_safe

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "DataError",
    "ExampleSampler",
    "load_examples",
    "render_continuation",
    "render_prompt",
    "to_json_safe",
]
