"""The OpenAI-compatible HTTP server over one engine (the ``server`` extra: FastAPI, uvicorn).

- :mod:`jaxkv.server.openai_api`: request bodies checked into prompts and sampling
  parameters, answers shaped from engine deltas (no web framework);
- :mod:`jaxkv.server.app`: the FastAPI routes over an :class:`~jaxkv.serving.async_engine.AsyncEngine`;
- :mod:`jaxkv.server.cli`: ``python -m jaxkv.server`` / ``jaxkv-server``.
"""
