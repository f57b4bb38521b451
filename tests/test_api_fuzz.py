"""Fuzz the REST service from its own OpenAPI spec (schemathesis): no input may give a 5xx, and every
answer must match the response schema the spec documents for its status."""

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

from memplan.api.app import create_app  # noqa: E402
from memplan.api.settings import Settings  # noqa: E402

# Small caps so that generated graphs and time limits stay cheap; a generous grace so that a slow
# machine does not turn a long solve into a 504.
APP = create_app(Settings(pool="thread", workers=2, max_ops=200, max_time_limit_s=2.0, default_time_limit_s=0.5,
                          grace_s=60.0, max_body_bytes=512 * 1024, max_frontier_points=16))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, response_schema_conformance])
