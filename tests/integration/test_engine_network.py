"""Every connection carries libpq's keepalive and timeout settings (a partitioned or
failed-over database is found dead in ~30 s, not the kernel's ~15 min); a URL's own win."""

from __future__ import annotations

from sqlalchemy.engine import make_url

from db.engine import NETWORK_OPTIONS, make_engine


def _options(url: str) -> dict[str, str]:
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            pgconn = conn.connection.driver_connection.pgconn  # type: ignore[union-attr]
            return {o.keyword.decode(): (o.val or b"").decode() for o in pgconn.info}
    finally:
        engine.dispose()


def test_keepalives_and_timeouts_are_set_and_the_url_may_override_them(database_url: str) -> None:
    options = _options(database_url)
    for key, value in NETWORK_OPTIONS.items():
        assert options[key] == str(value), key
    tuned = make_url(database_url).update_query_dict({"keepalives_idle": "60"})
    assert _options(tuned.render_as_string(hide_password=False))["keepalives_idle"] == "60"
