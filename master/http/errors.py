"""The HTTP status of each error a request to the job can cause (the job itself speaks no HTTP).

Together with the code (:mod:`master.job.errors`) it forms the row of the error table that tells an agent
whether to retry (:data:`elastic.control.error_table.ERROR_TABLE`).
"""

from __future__ import annotations

from elastic.errors import RequestRefused
from master.job.errors import (
    BadNodeSecretError,
    DuplicateNodeError,
    JobError,
    NodeExcludedError,
    SettingsMismatchError,
    UnknownNodeError,
)
from master.service.service import NotLeaderError

#: Error class -> HTTP status; a class missing here answers 400 (and fails tests/test_node_credentials).
HTTP_STATUS: dict[type[JobError], int] = {
    JobError: 400,
    UnknownNodeError: 404,
    SettingsMismatchError: 409,
    NodeExcludedError: 409,
    BadNodeSecretError: 403,
    DuplicateNodeError: 409,
    NotLeaderError: 503,
}


def http_status(error: JobError) -> int:
    """The status of the reply that carries ``error``."""
    return HTTP_STATUS.get(type(error), 400)


class ApiError(RequestRefused):
    """An error reply the HTTP layer answers as is (status, wire code, message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
