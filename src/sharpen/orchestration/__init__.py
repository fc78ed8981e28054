"""Orchestration: the RL loop (`loop.py`), the builders that turn config into components (`build.py`), one run
around them (`session.py`), and the runtimes that place the trainer and the engine: this process (`embedded.py`,
``runtime.type = "embedded"``) or Ray actors (`ray/`), chosen by `runtime.py`."""
