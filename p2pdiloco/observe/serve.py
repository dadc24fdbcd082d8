"""Small aiohttp servers (the dashboard, a peer's /metrics) started and stopped on a running asyncio loop."""

from __future__ import annotations

from aiohttp import web

from p2pdiloco.config import ConfigError


class HttpServer:
    """One aiohttp application listening on `host:port`; `port` 0 picks a free one (see `url`)."""

    def __init__(self, app: web.Application, host: str, port: int, what: str):
        self.app, self.host, self.port, self.what = app, host, port, what
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Listen, and return the URL to open. Raises ConfigError (one line) if the port cannot be used."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as e:
            await runner.cleanup()
            raise ConfigError(f"cannot serve the {self.what} on {self.host}:{self.port} ({e.strerror or e})") from None
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self.url

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host  # where a browser on this machine goes
        host = f"[{host}]" if ":" in host and host != "::" else ("[::1]" if host == "::" else host)
        return f"http://{host}:{self.port}/"

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
