"""The plan store a server opens: its SQLite cache, or the PostgreSQL store replicas share, by location."""

from __future__ import annotations

from memplan.api.cache import PlanCache, cache_backend
from memplan.api.pgcache import PostgresPlanCache


def open_cache(location: str, *, max_bytes: int = 0, store_timeout_s: float = 2.0) -> PlanCache | PostgresPlanCache:
    """The plan cache at ``location`` (:func:`memplan.api.cache.cache_backend`): a :class:`PlanCache`, or
    a :class:`PostgresPlanCache` (which starts degraded, not failing, when its database cannot be
    reached). Raises :class:`memplan.api.cache.CacheError` for a location it cannot use."""
    kind, where = cache_backend(location)
    if kind == "sqlite":
        return PlanCache(where, max_bytes=max_bytes)
    return PostgresPlanCache(where, max_bytes=max_bytes, store_timeout_s=store_timeout_s)
