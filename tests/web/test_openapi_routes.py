"""Every /v1 route is in the OpenAPI document (``GET /v1/openapi.json``),
so none escapes the schemathesis fuzz (tests/web/test_fuzz_api.py), which
takes its operations from that document."""

from __future__ import annotations

from pathlib import Path

from web.app import create_app
from web.openapi import OPENAPI
from web.settings import Settings


def test_every_v1_route_is_documented(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db"))
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.resource.canonical.startswith("/v1/") and r.method != "HEAD"}
    assert len(routes) >= 15
    documented = {(m, p) for p, ops in OPENAPI["paths"].items() for m in ops}
    missing = sorted(routes - documented)
    assert not missing, f"routes missing from web.openapi.OPENAPI (add them to their module's OPENAPI_PATHS): {missing}"
    assert not sorted(documented - routes), "documented operations that are not routes"


#: their 429 and 503 always carry Retry-After (web.limits, web.admission, web.drain)
RETRY_AFTER_DOCUMENTED = {"/v1/webrtc/offer", "/v1/devices", "/v1/devices/{device_id}", "/v1/devices/ws",
                          "/v1/admin/instances"}


def test_every_operation_documents_its_errors_as_json() -> None:
    for path, ops in OPENAPI["paths"].items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if int(status) >= 400 and (path, status) != ("/v1/turns/{turn_id}/stop", "409"):  # a stop's answer
                    schema = resp["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
                if status in ("429", "503") and path in RETRY_AFTER_DOCUMENTED:
                    assert resp["headers"]["Retry-After"]["required"], (method, path, status)
