"""The API key check of the HTTP routes, as FastAPI dependencies: each keyed route names
one in its decorator (`dependencies=KEYED`), so no handler runs, nor is its body
validated, for a client without a key. The keys and their comparison are the front
end's (FrontEnd.check_auth), which the gRPC API uses too."""

from fastapi import Depends, Request
from ray import serve

from router.api.frontend import FrontEnd


def _frontend() -> FrontEnd:
    # The ingress deployment's own object, found as Serve finds the `self` of its routes.
    return serve.get_replica_context().servable_object.frontend


# Async, so that the check runs on the event loop rather than in FastAPI's thread pool.
async def _bearer_key(request: Request) -> None:
    _frontend().check_auth(request.headers.get("authorization"))


async def _bearer_or_x_api_key(request: Request) -> None:
    _frontend().check_auth(request.headers.get("authorization"), request.headers.get("x-api-key"))


KEYED = [Depends(_bearer_key)]
# The Messages routes also take Anthropic's x-api-key header, which its SDK sends.
KEYED_MESSAGES = [Depends(_bearer_or_x_api_key)]
