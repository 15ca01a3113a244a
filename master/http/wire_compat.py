"""Replies a client of an older protocol revision can read (``X-Elastic-Protocol``).

Agents of the first release (revision 1) refuse fields they do not know in a reply, and a rolling
upgrade puts a newer master in front of them while they train. So the master leaves out of its replies
to such a client every field that revision lacks. Clients of later releases send the header and ignore
unknown fields themselves (``elastic.control.protocol._Reply``).

Revision 3 stopped sending an assignment's member list (every node got all N ids: O(N^2) bytes per
round); clients of revision 2 or older require it, so they still get it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.responses import Response
from pydantic import BaseModel

from elastic.control.protocol import PROTOCOL_VERSION, CommandReply, JobStatus, RoundReply

#: Reply type -> the fields revision 1 lacks (a pydantic ``exclude`` spec).
LACKING_IN_REVISION_1: dict[type[BaseModel], Any] = {
    CommandReply: {"term", "peer_keys", "replication_key"},
    RoundReply: {
        "assignment": {"term", "job_incarnation", "opening"},
        # Revision 1 knew these four fields only (the rest: the waiting figures of the agent's line).
        **dict.fromkeys(RoundReply.model_fields.keys() - {"status", "assignment", "outcome", "round"}, True),
    },
    JobStatus: {"nodes": {"__all__": {"excluded_reason", "readmit_in_s"}}},
}


#: Reply type -> the fields the current revision leaves out (older clients require them).
LEFT_OUT_SINCE_REVISION_3: dict[type[BaseModel], Any] = {
    RoundReply: {"assignment": {"members"}},
}

Reply = TypeVar("Reply", bound=BaseModel)


def _left_out(reply_type: type[BaseModel], client_revision: int) -> Any:
    """The ``exclude`` spec of a reply to a client of ``client_revision`` (None: the whole model)."""
    if client_revision >= 3:
        return LEFT_OUT_SINCE_REVISION_3.get(reply_type)
    if client_revision == 2:
        return None
    return LACKING_IN_REVISION_1.get(reply_type)


def revision(header: str | None) -> int:
    """The revision a request's ``X-Elastic-Protocol`` header names (absent or unreadable: 1)."""
    try:
        return max(1, int(header)) if header else 1
    except ValueError:
        return 1


def for_client(reply: Reply, client_revision: int) -> Reply | Response:
    """``reply`` as the client of ``client_revision`` (at most :data:`PROTOCOL_VERSION`) gets it: without
    the fields its revision lacks, or (current clients) those the current revision leaves out."""
    left_out = _left_out(type(reply), min(client_revision, PROTOCOL_VERSION))
    if left_out is None:
        return reply
    # Serialised as FastAPI serialises a returned model (model_dump_json: inf and nan become null).
    return Response(reply.model_dump_json(exclude=left_out), media_type="application/json")
