"""Which exceptions are the user's to fix (bad data, bad model folder) and how to say so in one line.

Anything not recognised here is a bug or an infrastructure fault and keeps its traceback.
"""

from __future__ import annotations


def user_error_message(error: BaseException) -> str | None:
    from sharpen.cli.models import PullError
    from sharpen.data import DataError
    from sharpen.environments.registry import EnvironmentLoadError
    from sharpen.environments.sandbox import SandboxUnavailable
    from sharpen.monitoring import TrackingSetupError

    if isinstance(error, DataError | PullError | EnvironmentLoadError | TrackingSetupError | SandboxUnavailable):
        return str(error)
    return None
