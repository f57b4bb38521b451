"""``submit`` and ``wait``: a plan request as a job on a running ``memplan serve`` (or a team's replicas
behind one address), for solves longer than a proxy or a terminal waits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.api.cli.base import app, emit_json, err, guard, out
from memplan.api.cli.files import writable, writing
from memplan.api.cli.options import FuseOpt, JsonOpt, StatesOnOpt, StatesOpt, fuse_mode, state_choice
from memplan.api.cli.planning import print_states
from memplan.planner.core.errors import MemplanError

ServerOpt = Annotated[str, typer.Option(envvar="MEMPLAN_SERVER", show_envvar=True,
                                        help="the memplan server's base URL")]
TokenOpt = Annotated[str | None, typer.Option(envvar="MEMPLAN_TOKEN", show_envvar=True,
                                              help="its bearer token, if it requires one")]


def _client(server: str, token: str | None) -> Any:
    import httpx

    if not server.startswith(("http://", "https://")):
        raise MemplanError(f"--server {server!r}: give the server's URL, e.g. http://127.0.0.1:8000")
    return httpx.Client(base_url=server.rstrip("/"), timeout=60,
                        headers={"Authorization": f"Bearer {token}"} if token else {})


def _call(client: Any, method: str, path: str, **kwargs: Any) -> Any:
    """The response, or one line naming the server that could not be reached."""
    import httpx

    try:
        return client.request(method, path, **kwargs)
    except httpx.TransportError as e:
        raise MemplanError(f"cannot reach the memplan server at {client.base_url}: {e}") from None


def _refused(r: Any) -> MemplanError:
    try:
        detail = r.json().get("detail", r.text)
    except ValueError:
        detail = r.text.strip()[:200]
    return MemplanError(f"the server answered {r.status_code}: {detail}")


@app.command()
@guard
def submit(
    graph_file: Annotated[Path, typer.Argument(help="graph.json")],
    budget: Annotated[str, typer.Option("--budget", "-b", help="e.g. 6GiB, 512MB, 123456 or 50%")],
    server: ServerOpt = "http://127.0.0.1:8000",
    solver: Annotated[str, typer.Option("--solver", "-s", help="auto, dp, ilp, greedy, ...")] = "auto",
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="seconds (default: the server's)")] = None,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="allow offloading to host memory")] = False,
    host_budget: Annotated[str | None, typer.Option(help="pinned host memory cap for offload, e.g. 8GiB")] = None,
    states: StatesOpt = None,
    states_on: StatesOnOpt = "auto",
    fuse: FuseOpt = None,
    token: TokenOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Submit a plan request as a job (POST /v1/jobs); prints the job's URL at once (memplan wait URL)."""
    if not graph_file.is_file():
        raise MemplanError(f"{graph_file}: no such file")
    try:
        graph = json.loads(graph_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise MemplanError(f"{graph_file}: not a JSON graph file ({e})") from None
    body: dict[str, Any] = {"graph": graph, "budget": int(budget) if budget.strip().isdigit() else budget,
                            "solver": solver, "offload": offload, "host_budget": host_budget,
                            "fuse": fuse_mode(fuse)}
    if time_limit is not None:
        body["time_limit_s"] = time_limit
    chosen = state_choice(states, states_on)  # the request's states: absent follows --offload, as solve's None
    if chosen is not None:
        body["states"] = {True: "auto", False: "none"}.get(chosen, chosen)
    with _client(server, token) as client:
        r = _call(client, "POST", "/v1/jobs", json=body)
        if r.status_code != 202:
            raise _refused(r)
        job = r.json()
    url = f"{server.rstrip('/')}{job['url']}"
    if json_out:
        emit_json({**job, "url": url})
    else:
        out.print(url, highlight=False, soft_wrap=True)
        err.print(f"job {job['id']} submitted; its answer: memplan wait {url}", highlight=False, soft_wrap=True)


@app.command()
@guard
def wait(
    job: Annotated[str, typer.Argument(help="the job's URL (what memplan submit printed), or its id with --server")],
    server: ServerOpt = "http://127.0.0.1:8000",
    output: Annotated[Path, typer.Option("-o", "--output", help="plan file to write")] = Path("plan.json"),
    timeout: Annotated[float, typer.Option(help="give up after this many seconds (the job goes on)")] = 3600.0,
    token: TokenOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Wait for a job's answer (GET /v1/jobs/ID, from any replica); write its plan. A refusal (an
    infeasible budget, ...) is one line and exit 2; the server away or restarting is waited out."""
    writable(output)
    if "/v1/jobs/" in job:
        server, job_id = job.split("/v1/jobs/", 1)
    else:
        job_id = job
    import httpx

    deadline = time.monotonic() + timeout
    with _client(server, token) as client:
        while True:
            try:
                r = client.get(f"/v1/jobs/{job_id}")
            except httpx.TransportError as e:  # a replica restarting: the job is in the store, ask again
                if time.monotonic() > deadline:
                    raise MemplanError(f"cannot reach the memplan server at {client.base_url}: {e}") from None
                time.sleep(1)
                continue
            if r.status_code == 200:
                break
            if r.status_code not in (202, 503):
                raise _refused(r)
            if time.monotonic() > deadline:
                raise MemplanError(f"job {job_id} still running after {timeout:g} s; wait again with: memplan wait "
                                   f"{server.rstrip('/')}/v1/jobs/{job_id}")
            time.sleep(float(r.headers.get("retry-after", "1")))
    answer = r.json()
    with writing(output):
        output.write_text(json.dumps(answer["plan"], indent=1) + "\n")
    summary = {"plan": str(output), "cache_hit": answer["cache_hit"], "solver": answer["solver"]["name"],
               "status": answer["solver"]["status"], "budget_bytes": answer["budget_bytes"],
               **{k: answer["predicted"][k] for k in ("peak_bytes", "step_time_s", "overhead")},
               **answer.get("state_summary", {})}  # (absent in an answer from an older server)
    if json_out:
        emit_json(summary)
    else:
        out.print(f"{output}: {summary['solver']} ({summary['status']}), peak {summary['peak_bytes']} B within "
                  f"{summary['budget_bytes']} B, overhead {summary['overhead']:.1%}", highlight=False)
        if "state_units" in summary:
            print_states(summary)
