"""``serve``: the REST service."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from memplan.api.cli.base import app, err, guard


# ---- serve: the REST service -------------------------------------------------------------------
@app.command()
@guard
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    cache: Annotated[str | None, typer.Option(
        envvar="MEMPLAN_CACHE_URL", show_envvar=True,
        help="plan cache: a SQLite file (':memory:' for none kept; default ~/.cache/memplan/plans.sqlite), or "
             "postgresql://user@host:port/dbname: a store several replicas share")] = None,
    workers: Annotated[int, typer.Option(min=1, max=256, help="solves that run at once (worker processes)")] = 2,
    token: Annotated[str | None, typer.Option(
        envvar="MEMPLAN_TOKEN", show_envvar=True,
        help="require 'Authorization: Bearer TOKEN' on every route but /healthz (for a shared server)")] = None,
    allowed_hosts: Annotated[str | None, typer.Option(
        "--allowed-hosts", envvar="MEMPLAN_ALLOWED_HOSTS", show_envvar=True,
        help="comma-separated Host header values to answer ('*': any); default: the loopback names when "
             "--host is a loopback address (against DNS rebinding), any otherwise")] = None,
) -> None:
    """Serve the REST API (OpenAPI docs at /docs). Other limits: MEMPLAN_* variables (see api/settings.py)."""
    import uvicorn

    from memplan.api.app import create_app
    from memplan.api.settings import Settings, default_cache_path, is_loopback
    from memplan.api.store import open_cache

    settings = Settings.from_env(cache_path=cache or default_cache_path(), workers=workers,
                                 **({"token": token} if token is not None else {}))
    settings = replace(settings, allowed_hosts=allowed_hosts if allowed_hosts is not None
                       else ",".join(settings.hosts_for(host)))
    # heal it, or refuse it in one line now (a scheme it does not know, a folder it cannot create)
    store = open_cache(settings.cache_path, max_bytes=settings.cache_max_bytes, store_timeout_s=settings.store_timeout_s)
    where, unreachable = store.describe(), store.error
    store.close()
    if unreachable:
        err.print(f"[yellow]warning:[/yellow] plan store {where} is {unreachable}: serving degraded (every request "
                  f"solved here, jobs refused with 503) until it answers", highlight=False, soft_wrap=True)
    if not is_loopback(host) and not settings.token:
        err.print(f"[yellow]warning:[/yellow] serving on {host} without --token: anyone who can reach this "
                  f"address can use the server", highlight=False)
    err.print(f"memplan serving on http://{host}:{port} (docs at /docs), plan cache {where}, "
              f"{settings.workers} {settings.pool} workers" + (", token required" if settings.token else ""),
              highlight=False)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
