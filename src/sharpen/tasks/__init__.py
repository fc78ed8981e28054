"""Repository tasks from real packages: plant a bug in a pure-Python package's function, keep it when the
package's own tests catch it (some fail, the rest pass), and describe it by its failing tests.

`build_task_set` (build.py) takes a package's sdist (sources.py), lists mutation sites in its functions
(mutations.py), runs the package's pytest suite on seeded mutants in the sandbox (`sharpen.environments.pytest_suite`,
which the repository environment's grader shares) and writes a task set
(the format is `sharpen.data.repo_tasks`); `check_task_set` proves each task fails as recorded and passes once the
original file is restored. `sharpen tasks build | check` is the command line; docs/repo_tasks.md the guide.

It sits above environments (it needs the sandbox) and beside evaluation; it knows no environment, trainer or
engine. Serving the tasks to a policy is an environment's job.
"""

from sharpen.tasks.build import BuildReport, BuildSettings, build_task_set, check_task_set
from sharpen.tasks.sources import TaskBuildError

__all__ = ["BuildReport", "BuildSettings", "TaskBuildError", "build_task_set", "check_task_set"]
