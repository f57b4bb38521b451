"""Fuzz the REST service from its own OpenAPI spec (schemathesis, every check): no input may give a
5xx, every answer must match the response schema documented for its status, schema-invalid requests
must be refused (``negative_data_rejection``) and schema-valid ones not refused for their form.

``positive_data_acceptance`` also counts 422 as accepting: a request can be well formed and still be
refused for what no JSON Schema expresses (a graph with a cycle or a dangling edge, a budget below the
minimum, a plan made for another graph); those refusals are each tested in test_api.py. And 404: a
well-formed job id that no job has (``GET /v1/jobs/{job_id}``, tested in test_cache_backends.py). A longer
run by hand is reported in docs/benchmarks.md.
"""

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from memplan.api.app import create_app  # noqa: E402
from memplan.api.settings import Settings  # noqa: E402

# Small caps so that generated graphs and time limits stay cheap; a generous grace so that a slow
# machine does not turn a long solve into a 504.
APP = create_app(Settings(pool="thread", workers=2, max_ops=200, max_time_limit_s=2.0, default_time_limit_s=0.5,
                          grace_s=60.0, max_body_bytes=512 * 1024, max_frontier_points=16))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
schema.config.checks.positive_data_acceptance.expected_statuses = ["2xx", "404", "422"]


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case):
    case.call_and_validate()  # every check schemathesis has
