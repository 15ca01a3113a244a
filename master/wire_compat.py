"""Replies a client of an older protocol revision can read (``X-Elastic-Protocol``).

Agents of the previous release (revision 1) refuse fields they do not know in a reply, and a rolling
upgrade puts a newer master in front of them while they train. So the master leaves out of its replies
to such a client every field that revision lacks. Clients of this release send the header and ignore
unknown fields themselves (``elastic.protocol._Reply``).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel

from elastic.protocol import PROTOCOL_VERSION, CommandReply, JobStatus, RoundReply

#: Reply type -> the fields revision 1 lacks (a pydantic ``exclude`` spec).
LACKING_IN_REVISION_1: dict[type[BaseModel], Any] = {
    CommandReply: {"term"},
    RoundReply: {"assignment": {"term"}},
    JobStatus: {"nodes": {"__all__": {"excluded_reason", "readmit_in_s"}}},
}


def revision(header: str | None) -> int:
    """The revision a request's ``X-Elastic-Protocol`` header names (absent or unreadable: 1)."""
    try:
        return max(1, int(header)) if header else 1
    except ValueError:
        return 1


def for_client(reply: BaseModel, client_revision: int) -> BaseModel | Response:
    """``reply`` as the client can read it: itself for a current client, else without the newer fields."""
    if client_revision >= PROTOCOL_VERSION:
        return reply
    lacking = LACKING_IN_REVISION_1.get(type(reply))
    if lacking is None:
        return reply
    # Serialised as FastAPI serialises a returned model (model_dump_json: inf and nan become null).
    return Response(reply.model_dump_json(exclude=lacking), media_type="application/json")
