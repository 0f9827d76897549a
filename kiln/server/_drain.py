"""A refused request body read to its end before the answer, so ordinary clients see the answer.

A server that answers (413, 415) and closes while the client is still sending resets the connection under it:
``urllib``, ``requests`` and ``httpx`` then report a broken connection, never the status that explains it. A refusal
made from the headers alone, before a byte of the body was read, is marked ``unread``; the error handlers then read
and drop that body (``drain_refused``), up to ``DRAIN_BYTES`` and only as far as its declared ``Content-Length`` --
so the end is known -- and only while the bytes keep coming: a client that sent its headers and waits for the
answer before sending the body (``Expect: 100-continue``, or any client that pauses for ``DRAIN_IDLE_S``) gets the
answer without sending it. Nothing of it is kept; a longer body, or one of unknown length, still gets the close.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from kiln.errors import KilnError

__all__ = ["DRAIN_BYTES", "DRAIN_IDLE_S", "drain_refused", "unread"]

DRAIN_BYTES = 256 * 1024 * 1024  # the most of a refused body read (and dropped) so its client can read the answer
DRAIN_IDLE_S = 5.0  # a client whose body stops arriving for this long is answered without the rest of it


def unread(exc: KilnError) -> KilnError:
    """``exc``, marked as refusing a body from its headers before a byte of it was read."""
    exc.unread_body = True  # type: ignore[attr-defined]
    return exc


async def drain_refused(request: Request, exc: KilnError) -> None:
    """Read and drop the body ``exc`` refused unread, as far as its declared length (at most ``DRAIN_BYTES``)."""
    declared = request.headers.get("content-length", "").strip()
    if not getattr(exc, "unread_body", False) or not declared.isdigit() or int(declared) > DRAIN_BYTES:
        return
    if request.headers.get("expect", "").strip().lower() == "100-continue":
        return  # it sends the body only when told to continue: the answer is all it needs
    remaining = int(declared)
    while remaining > 0:
        try:
            message = await asyncio.wait_for(request.receive(), DRAIN_IDLE_S)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        remaining -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return
