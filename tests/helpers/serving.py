"""An ASGI app served by uvicorn on a free loopback port in a daemon thread, for tests; the engine the
stand-in inference servers (``fake_vllm.py``, ``fake_sglang.py``) put behind their routes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from areno.models.hf_io import load_model
from areno.rollout.client import InProcessRolloutClient
from areno.rollout.engine import RolloutEngine, RolloutEngineConfig
from areno.rollout.server import ServerThread


@contextlib.contextmanager
def serving(app, *, log_level: str = "error") -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:<port>``)."""
    server = ServerThread(app, log_level=log_level, name="test-server").start()
    try:
        yield server.base_url
    finally:
        server.stop()


def stand_in_engine(model_dir: Path, eos_token_id: int) -> tuple[RolloutEngine, InProcessRolloutClient]:
    """areno's CPU engine for a stand-in inference server, and its in-process client."""
    model, model_config = load_model(model_dir)
    engine = RolloutEngine(
        model,
        model_config,
        # like the real servers' sync (SGLang's retracted requests, vLLM's reset running requests): the
        # requests in flight recompute their context under the new weights
        config=RolloutEngineConfig(device="cpu", max_num_seqs=64, recompute_kv_on_weight_update=True),
        eos_token_ids=[eos_token_id],
    )
    return engine, InProcessRolloutClient(engine)
