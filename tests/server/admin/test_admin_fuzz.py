"""Property-based fuzzing of the admin API from its own OpenAPI document (schemathesis).

Every operation gets generated requests, valid and invalid (authenticated), against a
seeded registry on each backend: no response may be a 5xx, every response must match the
schema the OpenAPI document declares for its status, and every 4xx must carry the one
error shape. Example counts are small so the suite stays fast.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.generation import GenerationMode

from server.app import create_app
from tests.server.admin.conftest import AUTH, seed


def test_admin_api_never_answers_5xx(db, settings, client) -> None:  # type: ignore[no-untyped-def]
    seed(client)
    client.post("/admin/v1/tenants/acme/keys", headers=AUTH, json={"name": "k"})
    app = create_app(settings, session_factory=db.factory)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app.state.admin_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis_settings(
                max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
            )
            def check(case) -> None:  # type: ignore[no-untyped-def]
                response = case.call(headers=AUTH)
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
                assert response.status_code < 500, (case.method, case.path, case.body, response.text)
                if response.status_code >= 400:
                    body = response.json()
                    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}, body

            check()
