"""WhaleZen's Python client and `whalezen` CLI: HTTP to the v1 API, nothing of `broker/` imported.

    from whalezen import Client
    wz = Client("http://127.0.0.1:8000", token="wz_...")      # or Client.from_login()
    job = wz.submit({"name": "train", "command": ["python", "train.py"], "resources": {"gpus": 1}})
    wz.job(job["id"])["state"]

Errors are exceptions (`whalezen.errors`): `BadRequest.fields` holds the API's field errors.
"""
from whalezen.client import Client
from whalezen.errors import (ApiError, AuthError, BadRequest, Conflict, Forbidden, NotFound, NotSupported,
                             ServerError, SpecError, Throttled, Unreachable, WhaleZenError)

__version__ = "0.1.0"

__all__ = ["Client", "WhaleZenError", "ApiError", "BadRequest", "AuthError", "Forbidden", "NotFound",
           "NotSupported", "Conflict", "Throttled", "ServerError", "Unreachable", "SpecError", "__version__"]
