"""The errors a request to the job can cause. Each names itself on the wire with ``code`` (the error
table in :mod:`elastic.control.error_table`); the HTTP status belongs to the HTTP layer
(:mod:`master.http.errors`).
"""

from __future__ import annotations

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import NODE_SECRET_HEADER
from elastic.errors import RequestRefused


class JobError(RequestRefused):
    """Base of the errors a request can cause; ``code`` names it on the wire."""

    code = ErrorCode.JOB_ERROR


class UnknownNodeError(JobError):
    """The node never joined, or it was declared dead or left: it must join (again)."""

    code = ErrorCode.UNKNOWN_NODE


class SettingsMismatchError(JobError):
    """The node runs with other job settings (``--nnodes``) than the job."""

    code = ErrorCode.SETTINGS_MISMATCH


class NodeExcludedError(JobError):
    """The node check excluded the node from this job."""

    code = ErrorCode.NODE_EXCLUDED


class BadNodeSecretError(JobError):
    """A request for a known node without that node's current secret (master.job.liveness)."""

    code = ErrorCode.BAD_NODE_SECRET

    @classmethod
    def for_node(cls, node_id: str, secret_given: bool) -> BadNodeSecretError:
        """The refusal of a request for ``node_id`` that carried no secret, or a wrong one."""
        if not secret_given:
            return cls(
                f"request for node {node_id} carries no node secret ({NODE_SECRET_HEADER}); only the "
                f"agent that joined as {node_id} may act for it"
            )
        return cls(
            f"wrong node secret for node {node_id}: another agent joined as {node_id} since "
            f"(give every agent its own --node-id), or the request does not come from its agent"
        )


class DuplicateNodeError(JobError):
    """A join under the id of a node whose agent is alive, without that agent's secret."""

    code = ErrorCode.DUPLICATE_NODE
