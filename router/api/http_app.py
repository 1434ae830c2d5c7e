"""The FastAPI app that the ingress deployment (router/api/http.py) serves: errors in
OpenAI's shape (Anthropic's on the Messages routes), 400 rather than FastAPI's 422 for
bad bodies, and the OpenAPI schema and error answers that the routes document."""

import functools

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.api import anthropic
from router.api.body_limit import BodySizeLimit
from router.api.protocol import ErrorResponse, main_error
from router.generation import APIError

app = FastAPI(title="kvserve")
app.add_middleware(BodySizeLimit)

ERRORS = {
    400: "invalid request",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "overloaded; retry after Retry-After seconds",
    503: "no replica could serve the request",
}
ERROR_401 = {"model": ErrorResponse, "description": ERRORS[401]}
ERROR_404 = {"model": ErrorResponse, "description": ERRORS[404]}
ERROR_400 = {"model": ErrorResponse, "description": ERRORS[400]}
GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream"},
    **{status: {"model": ErrorResponse, "description": why} for status, why in ERRORS.items()},
}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, less its 422 answers: validation errors here are OpenAI's 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="0.1.0", routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


# Bound to the app object, not read from this module: Serve serves a copy of the app,
# pickled by @serve.ingress, whose routes are the ones to list; a replica need not
# import router/api/http.py, which adds the routes to this module's app.
app.openapi = functools.partial(_openapi, app)


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", path: str = ""
):
    """OpenAI's error body; Anthropic's on the Messages routes, whose SDK reads that one."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    if anthropic.is_messages_path(path):
        body = anthropic.error_body(status, message)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(APIError)
async def _api_error(request: Request, e: APIError):
    return error_response(e.status, e.message, e.param, e.kind, request.url.path)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    # OpenAI answers 400 (not FastAPI's 422) for malformed bodies and bad values.
    first = main_error(list(e.errors()))
    if first.get("type") == "json_invalid":
        message = f"body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        return error_response(400, message, path=request.url.path)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
    return error_response(400, message, where, path=request.url.path)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    """FastAPI's own errors (unreadable body, unknown path, wrong method) in OpenAI's shape."""
    response = error_response(e.status_code, str(e.detail), path=request.url.path)
    response.headers.update(e.headers or {})
    return response
