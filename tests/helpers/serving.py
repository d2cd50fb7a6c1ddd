"""An ASGI app served by uvicorn on a free loopback port in a daemon thread, for tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from areno.launch.scheduler import free_port


@contextlib.contextmanager
def serving(app, *, log_level: str = "error") -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:<port>``)."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
