"""TurboRAG inside stock vLLM: a KV connector (connector.py) that hands vLLM's hooks to its
scheduler side (scheduler_side.py), its worker side (worker_side.py) and, as kv_both, its save
role (save_side.py), configured once (config.py), over a model-free claim planner (claim.py).
Importing this package does not import vLLM; `connector` and `metrics` do."""
