"""TurboRAG inside stock vLLM: a KV connector (connector.py) over a model-free claim planner
(claim.py). Importing this package does not import vLLM; `connector` does."""
