"""`turborag serve`: an OpenAI-compatible HTTP server over one TurboRAGEngine.

    from turborag_integrations.server.app import create_app, serve

app (the FastAPI routes), schemas (request bodies), responses (OpenAI's response bodies and
errors), service (what the endpoints do with the engine), finder (chunk texts found in a prompt by
content), worker (one engine call at a time), metrics (Prometheus text). The app needs the
`server` extra: `pip install 'turborag-integrations[server]'` (FastAPI and uvicorn); finder,
worker and metrics need neither.
"""
