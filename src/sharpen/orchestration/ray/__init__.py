"""The Ray runtime (`runtime.run_ray`): the trainer and the engine as Ray actors, driven by the same loop.

The only package that imports ``ray`` (an import-linter contract). This file imports nothing, so that importing
`sharpen.orchestration` never starts or needs Ray.
"""
