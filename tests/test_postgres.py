"""infra/start-postgres.sh + infra/start-server.sh: a real PostgreSQL cluster and a Prefect server on it.

Runs the scripts as users do, into temporary folders on free loopback ports, checks that the server is
healthy and stores its data in this PostgreSQL database, that the password never reaches a file or the
scripts' output, that rerunning the scripts is harmless, and that infra/stop-all.sh stops everything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
# Characters that must be percent-encoded in a URL, so the test also covers the server's URL building.
PASSWORD = "kd fl@w:p%ss/" + os.urandom(6).hex()



def _missing_tools() -> str | None:
    missing = [t for t in ("initdb", "pg_ctl", "psql") if shutil.which(t) is None]
    if missing:
        return f"PostgreSQL tools not installed: {', '.join(missing)}"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' system user (initdb refuses root)"
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        return "asyncpg is not installed (the [postgres] extra)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(name: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(INFRA / name)], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{name} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def infra_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    reason = _missing_tools()
    if reason:
        pytest.skip(reason)
    # The cluster folder must be reachable by the `postgres` user: pytest's own tmp folders are closed to it.
    pgdata = Path(tempfile.mkdtemp(prefix="kdflow-pgdata-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KDFLOW_"))}
    env.update(
        KDFLOW_STATE_DIR=str(tmp_path / "state"), KDFLOW_PGDATA=str(pgdata), KDFLOW_PG_PORT=str(free_port()),
        KDFLOW_PREFECT_PORT=str(free_port()), KDFLOW_PG_PASSWORD=PASSWORD, KDFLOW_PYTHON=sys.executable,
        PREFECT_HOME=str(tmp_path / "client-home"), KDFLOW_SERVER_TIMEOUT="150",
    )
    try:
        yield env
    finally:
        subprocess.run(["bash", str(INFRA / "stop-all.sh")], env=env, capture_output=True, timeout=120)
        shutil.rmtree(pgdata, ignore_errors=True)


def psql(env: dict[str, str], sql: str) -> str:
    """A query over TCP as the Prefect database user, with the password from the environment."""
    result = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", env["KDFLOW_PG_PORT"], "-U", "prefect", "-d", "prefect", "-X", "-tA", "-c",
         sql],
        env=env | {"PGPASSWORD": PASSWORD}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_prefect_server_on_postgres(infra_env: dict[str, str]) -> None:
    env = infra_env
    started = time.perf_counter()
    first = run_script("start-postgres.sh", env)
    again = run_script("start-postgres.sh", env)  # rerun: no error, same URL
    postgres_s = time.perf_counter() - started
    url = f"postgresql+asyncpg://prefect:${{KDFLOW_PG_PASSWORD}}@127.0.0.1:{env['KDFLOW_PG_PORT']}/prefect"
    assert first.stdout.strip() == url and again.stdout.strip() == url

    started = time.perf_counter()
    server = run_script("start-server.sh", env)
    server_s = time.perf_counter() - started
    api_url = f"http://127.0.0.1:{env['KDFLOW_PREFECT_PORT']}/api"
    assert server.stdout.strip() == f"export PREFECT_API_URL={api_url}"
    assert json.load(urllib.request.urlopen(f"{api_url}/health", timeout=10)) is True
    assert run_script("start-server.sh", env).stdout.strip() == server.stdout.strip()  # rerun: reuses it

    # The server keeps its data in this PostgreSQL database: a flow created through the API is a row there.
    request = urllib.request.Request(f"{api_url}/flows/", data=json.dumps({"name": "kdflow-postgres-check"}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    flow_id = json.load(urllib.request.urlopen(request, timeout=10))["id"]
    assert psql(env, f"SELECT name FROM flow WHERE id = '{flow_id}'") == "kdflow-postgres-check"
    tables = "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('flow_run', 'deployment')"
    assert int(psql(env, tables)) == 2
    # A deployment's parameter schema comes back from jsonb with its keys reordered (by length); the form's
    # `position` still gives every nested section in definition order, which is how Prefect's UI sorts it.
    from prefect.utilities.callables import parameter_schema

    from kdflow.flows.precompute import precompute_flow
    from kdflow.schemas.config import StudentConfig

    body = {"name": "form-check", "flow_id": flow_id,
            "parameter_openapi_schema": parameter_schema(precompute_flow.fn).model_dump()}
    request = urllib.request.Request(f"{api_url}/deployments/", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    deployment_id = json.load(urllib.request.urlopen(request, timeout=10))["id"]
    stored = json.load(urllib.request.urlopen(f"{api_url}/deployments/{deployment_id}",
                                              timeout=10))["parameter_openapi_schema"]
    fields = stored["definitions"]["StudentConfig"]["properties"]
    assert list(fields) != list(StudentConfig.model_fields)  # jsonb's order
    assert sorted(fields, key=lambda key: fields[key]["position"]) == list(StudentConfig.model_fields)
    listing = subprocess.run([str(Path(sys.executable).parent / "prefect"), "flow-run", "ls"],
                             env=env | {"PREFECT_API_URL": api_url},
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr

    # The password is in no file the scripts wrote and in none of their output.
    for text in (first.stdout, first.stderr, server.stdout, server.stderr):
        assert PASSWORD not in text
    for path in Path(env["KDFLOW_STATE_DIR"]).rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), f"the password leaked into {path}"

    run_script("stop-all.sh", env)
    run_script("stop-all.sh", env)  # rerun: nothing left to stop, no error
    assert not (Path(env["KDFLOW_PGDATA"]) / "postmaster.pid").exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{api_url}/health", timeout=2)
    print(json.dumps({"postgres_start_s": round(postgres_s, 1), "prefect_server_start_s": round(server_s, 1)}))
