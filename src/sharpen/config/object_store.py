"""How a run reaches the S3-compatible object store that holds its checkpoints (``run.checkpoint_uri``): the endpoint
and the names of the environment variables with the credentials. Secrets never go into a recipe: every process (the
driver and each trainer rank) reads them from its own environment."""

from __future__ import annotations

from pydantic import model_validator

from sharpen.config.section import Section


class ObjectStoreConfig(Section):
    endpoint_url: str | None = None
    """The S3 endpoint (``http://127.0.0.1:8333``, ``https://minio.example:9000``); None: AWS's, or whatever botocore
    reads from the environment (AWS_ENDPOINT_URL)."""
    key_env: str | None = None
    """Name of the environment variable holding the access key id; None: botocore's usual sources
    (AWS_ACCESS_KEY_ID, a profile, an instance or pod role)."""
    secret_env: str | None = None
    """Name of the environment variable holding the secret access key (with key_env)."""

    @model_validator(mode="after")
    def _check_pair(self) -> ObjectStoreConfig:
        if (self.key_env is None) != (self.secret_env is None):
            raise ValueError("give key_env and secret_env together, or neither")
        return self
