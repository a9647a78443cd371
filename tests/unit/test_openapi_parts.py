"""The OpenAPI document is put together from one part per resource: each path and each
component schema comes from exactly one part, and every one is placed in the document's
order (a new one not listed there would go last, unnoticed)."""

from __future__ import annotations

from api.openapi import PARTS, PATH_ORDER, SCHEMA_ORDER, openapi_document
from api.openapi.common import Context
from runtime.config import Settings


def test_each_path_and_schema_comes_from_one_part_in_the_documents_order() -> None:
    c = Context(Settings(), ["a"], True)
    paths = [p for part in PARTS for p in part.paths(c)]
    schemas = [s for part in PARTS for s in part.schemas(c)]
    assert len(paths) == len(set(paths)), "a path given by two parts"
    assert len(schemas) == len(set(schemas)), "a schema given by two parts"
    assert sorted(paths) == sorted(PATH_ORDER)
    assert sorted(schemas) == sorted(SCHEMA_ORDER)
    document = openapi_document(Settings(), ["a"], any_json_input=True, auth=True)
    assert tuple(document["paths"]) == PATH_ORDER
    assert tuple(document["components"]["schemas"]) == SCHEMA_ORDER
