"""Errors in OpenAI's shape: one exception type inside, one JSON body at the edge."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.api.protocol import CHAT_ROLES


class ApiError(Exception):
    """A request that ends with an HTTP error; raised anywhere, rendered by the handlers below."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or default_error_type(status_code)
        self.headers = headers

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def default_error_type(status_code: int) -> str:
    return "server_error" if status_code >= 500 else "invalid_request_error"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem pydantic found, named by its parameter path."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"We could not parse the JSON body of your request. ({detail})", code="invalid_json")
    if first.get("type") == "invalid_unicode":
        param = first["ctx"]["param"]
        return ApiError(400, f"Invalid value for '{param}': {first['msg']}.", param=param or None)
    if tuple(first.get("loc", ())) in {(), ("body",)}:
        return ApiError(400, "The request body must be a JSON object.")
    # A value that fits none of a union's types fails once per type; report it once, at the field.
    same_field = [_location(error) for error in errors if _location(error)[:2] == _location(first)[:2]]
    param = ".".join(str(part) for part in _common_prefix(same_field) if part != "body")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param)
    message = f"Invalid value for '{param}': {first['msg']}"
    if len(same_field) > 1:
        message += f" (nor does it fit any of the {len(same_field) - 1} other accepted forms)"
    if len(errors) > len(same_field):
        message += f"; and {len(errors) - len(same_field)} more problems"
    return ApiError(400, message, param=param)


def _location(error: dict) -> tuple:
    """The error's location in the request, without the role tags of chat-message unions."""
    loc = tuple(error["loc"])
    return tuple(
        part for index, part in enumerate(loc) if not (part in CHAT_ROLES and index and isinstance(loc[index - 1], int))
    )


def _common_prefix(paths: list[tuple]) -> tuple:
    prefix = paths[0]
    for path in paths[1:]:
        length = 0
        while length < min(len(prefix), len(path)) and prefix[length] == path[length]:
            length += 1
        prefix = prefix[:length]
    return prefix


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, expected or not, has the OpenAI body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Keeps the exception's headers: a 405 names the allowed methods in `Allow`.
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return ApiError(exc.status_code, message, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, __: Exception) -> JSONResponse:
        # Starlette re-raises after this response, so the server logs the traceback.
        return ApiError(500, "The server had an error while processing your request.").response()
