"""Schema-driven fuzzing of the live server on the tiny model (schemathesis): requests generated from the server's
own OpenAPI document, valid and invalid, a bounded number per route. No answer may be a 5xx, and every answer
must be one the document lists, with its media type, headers and body schema."""


import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz test needs the `test` extra (schemathesis)")

from helpers import serve_on_loopback  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from qwen4exp.config import EngineConfig  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402
from qwen4exp.entrypoints.async_engine import AsyncEngine  # noqa: E402
from qwen4exp.entrypoints.server import build_app  # noqa: E402
from qwen4exp.weights.random_checkpoint import make_random  # noqa: E402

KEY = "fuzz"
# short sequences keep each generated request cheap: a few hundred of them run in about a minute
LIMITS = dict(max_model_len=48, max_num_seqs=4, max_num_batched_tokens=64, cpu_cache_bytes=1 << 22)
CASES_PER_ROUTE = 80
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_random(path, "tiny", dtype="float32")
    engine = LLMEngine(path, EngineConfig(**LIMITS, dtype="float32", device="cpu"))
    async_engine = AsyncEngine(engine, max_queued_requests=4).start()
    app = build_app(async_engine, "tiny", api_key=KEY, renderer_timeout=5.0)
    with serve_on_loopback(app) as url:
        yield url
    async_engine.shutdown()
    assert engine.cache.all_free()  # nothing the fuzzing did leaked a page or a slot


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    return schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/metrics")]


def test_the_document_lists_every_route(api_schema):
    listed = {(method.upper(), path) for path, ops in api_schema.raw_schema["paths"].items() for method in ops}
    assert listed == set(ROUTES)


@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_answer_is_documented_and_none_is_a_5xx(api_schema, method, path):
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=CASES_PER_ROUTE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS, timeout=60)

    fuzz()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 3}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "max_tokens": 3})])
def test_streamed_replies_are_the_events_the_document_describes(api_schema, path, body):
    """Every event of a streamed reply (a JSON chunk, then [DONE]) against the document's event schema: the fuzzing
    above reaches a valid streamed request only now and then."""
    case = api_schema[path]["POST"].Case(body=body)
    response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    case.validate_response(response, checks=[content_type_conformance, response_schema_conformance])
