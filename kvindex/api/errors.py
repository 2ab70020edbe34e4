"""The API's answer to a request with bad arguments, one type on both sides of the wire."""


class BadRequest(ValueError):
    """The request's arguments are wrong; the message names the problem. The servicer raises it and
    answers ``INVALID_ARGUMENT`` (or ``ScoreResponse.error`` on a stream) with the message; the client
    raises it on such an answer. A caller's error: a client never answers it with its fallback."""
