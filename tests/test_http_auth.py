"""Who may come in: `--api-key` (every /v1/* request needs `Authorization: Bearer <key>`, else 401 as an
OpenAI error object; /health and /metrics open) and HTTPS through hypercorn's own TLS options, with a
self-signed certificate made here by the `openssl` command."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from http_harness import ServedModel

from dsv4serve import cli
from dsv4serve.config import EngineConfig

KEY = "s3cret-key"
ENGINE = EngineConfig(device="cpu", dtype="float32", page_size=8, max_num_seqs=4, max_total_tokens=512)


def self_signed(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def secured(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServedModel, Path]]:
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    model = ServedModel(tiny_model_dir, ENGINE, api_key=KEY, ssl_certfile=str(cert), ssl_keyfile=str(key))
    yield model, cert
    model.close()


def test_requests_without_the_key_get_401_and_open_endpoints_stay_open(
    secured: tuple[ServedModel, Path],
) -> None:
    served, cert = secured
    assert served.url.startswith("https://")
    with httpx.Client(base_url=served.url, verify=ssl.create_default_context(cafile=str(cert))) as http:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY},
            {"Authorization": "Basic x"},
        ):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                r = http.request(method, path, headers=headers, json={"model": "tiny", "prompt": "a"})
                assert r.status_code == 401, (headers, path)
                error = r.json()["error"]
                assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        ok = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"


def test_the_openai_client_with_the_key_works_over_tls(secured: tuple[ServedModel, Path]) -> None:
    served, cert = secured
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as transport:
        good = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, http_client=transport, max_retries=0)
        done = good.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert done.choices[0].finish_reason in ("length", "stop") and done.usage is not None
        stream = good.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        assert [c for c in stream]  # streamed to [DONE]
        bad = openai.OpenAI(base_url=served.url + "/v1", api_key="nope", http_client=transport, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="hello", max_tokens=3)


def test_tls_options_go_together_and_the_key_may_come_from_the_environment(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["serve", "--model", str(tiny_model_dir), "--http", "--ssl-certfile", "c.pem"]
    assert cli.main(args) == 2
    assert "--ssl-certfile and --ssl-keyfile go together" in capsys.readouterr().err
    monkeypatch.setenv("DSV4SERVE_API_KEY", KEY)
    assert cli.build_parser().parse_args(["serve", "--model", "m", "--http"]).api_key == KEY
    given = cli.build_parser().parse_args(["serve", "--model", "m", "--http", "--api-key", "other"])
    assert given.api_key == "other"
