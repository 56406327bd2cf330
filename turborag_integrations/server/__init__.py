"""`turborag serve`: an OpenAI-compatible HTTP server over one TurboRAGEngine.

    from turborag_integrations.server.app import create_app, serve

app (the FastAPI routes), schemas (request bodies), responses (OpenAI's response bodies and
errors), service (what the endpoints do with the engine, through a batch scheduler), outputs
(the scheduler's token ids turned into each request's text, on the event loop), disconnect (a
client that leaves, noticed as it leaves), guards (API key and body size, checked before a body
is read), finder (chunk texts found in a prompt by content), rapid (RAPID answers, for requests
that ask with `turborag_rapid`), metrics (Prometheus text). The app
needs the `server` extra: `pip install 'turborag-integrations[server]'` (FastAPI, uvicorn,
prometheus_client and sse-starlette); finder needs none of them, metrics only prometheus_client.
"""
