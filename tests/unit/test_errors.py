from __future__ import annotations

import inspect

import pytest

from service import errors
from service.api.errors import http_status
from service.errors import ServiceError


def all_errors() -> list[type[ServiceError]]:
    found: list[type[ServiceError]] = []
    todo: list[type[ServiceError]] = [ServiceError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == errors.__name__]


def takes_only_a_message(cls: type[ServiceError]) -> bool:
    init = next(k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__)
    if not inspect.isfunction(init):
        return True  # a builtin's __init__ (OSError...) takes the message
    params = list(inspect.signature(init).parameters.values())[1:]
    return sum(p.default is inspect.Parameter.empty for p in params) == 1


@pytest.mark.parametrize(
    "cls", [c for c in all_errors() if takes_only_a_message(c)], ids=lambda c: c.__name__
)
def test_every_error_carries_its_message_whatever_builtin_it_mixes_in(
    cls: type[ServiceError],
) -> None:
    exc = cls("the detail")
    assert exc.message == "the detail"
    assert 400 <= http_status(exc) < 600


def test_error_codes_are_unique() -> None:
    codes = [c.code for c in all_errors()]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize(
    ("cls", "status"),
    [
        (errors.UnsupportedExport, 422),
        (errors.SourceNotAllowed, 422),  # a PermissionError, yet the request's fault
        (errors.RepositoryNotFound, 422),
        (errors.UnsafePickle, 422),
        (errors.JobNotFound, 404),
        (errors.Conflict, 409),
        (errors.TenantLimitExceeded, 429),
        (errors.Unauthorized, 401),
        (errors.Forbidden, 403),
        (errors.PathOutsideRoot, 403),
        (errors.VerificationFailed, 500),
        (errors.ToolMissing, 503),
        (errors.ServiceError, 500),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_the_api_maps_each_domain_error_to_its_http_status(
    cls: type[ServiceError], status: int
) -> None:
    assert http_status(cls.__new__(cls)) == status
