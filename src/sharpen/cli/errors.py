"""Which exceptions are the user's to fix (bad data, a model that cannot be pulled, a plugin that does not load, a
host without the sandbox or tracker a recipe asks for) and how to say so in one line.

Anything not recognised here is a bug or an infrastructure fault and keeps its traceback.
"""

from __future__ import annotations


def user_error_message(error: BaseException) -> str | None:
    from sharpen.cli.models import PullError
    from sharpen.data import DataError
    from sharpen.data.chat import ImageInputError
    from sharpen.environments.base import EnvironmentCodeError
    from sharpen.environments.sandbox import SandboxUnavailable
    from sharpen.monitoring import RunStopped, TrackingSetupError
    from sharpen.plugins import PluginLoadError
    from sharpen.serving import ServiceRequestError, ServiceUnavailable

    one_line = (
        DataError,
        ImageInputError,
        PullError,
        PluginLoadError,
        TrackingSetupError,
        SandboxUnavailable,
        EnvironmentCodeError,
        RunStopped,
    )
    if isinstance(error, one_line):
        return str(error)
    if isinstance(error, ServiceUnavailable | ServiceRequestError):  # raised when a client starts: URLs or token
        return f"a remote service (remote.urls) cannot be used: {error}"
    return None
