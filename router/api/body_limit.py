"""Request body size limit for the HTTP ingress, as ASGI middleware: an oversized body
gets 413 before any of it is parsed or held beyond the limit."""

import json

from router.api.anthropic import error_body, is_messages_path

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 128k-token prompt as text or as token ids fits


class BodySizeLimit:
    """Reads the whole body first (FastAPI would anyway), at most max_bytes of it.

    The limit is read from the app's `state.max_request_bytes` on each request, so the
    ingress can set it from its config after the app was built."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = getattr(scope["app"].state, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await _too_large(send, limit, scope["path"])

        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # disconnected
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await _too_large(send, limit, scope["path"])
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _too_large(send, limit: int, path: str) -> None:
    """In OpenAI's error shape, or Anthropic's on the Messages routes."""
    message = f"request body is larger than the limit of {limit} bytes"
    error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 413}}
    body = json.dumps(error_body(413, message) if is_messages_path(path) else error).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
