"""Property-based fuzzing of the REST API from its own OpenAPI document (schemathesis):
whatever it sends, the API answers without a 5xx and as its document says."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from api import create_app
from runtime.bootstrap import Runtime
from tasks.celery_app import make_celery
from tests.support import submit


def test_no_server_errors_and_documented_responses(runtime: Runtime) -> None:
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    for _ in range(3):  # something to find, list and cancel
        submit(runtime.store, agent="acme-tickets")
    schema = schemathesis.openapi.from_wsgi("/api/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    failures: list[str] = []

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call()
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")
            # Every response must match the document. Schema-valid requests may still be
            # refused on their meaning (an Idempotency-Key reused with another body: 422),
            # so the "valid data is accepted" check does not apply.
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

        check()
    assert failures == []
