"""The framework-free engine. Layers, each importing only those above it in this list:

- settings, errors: what a caller can choose, and what can go wrong
- attention: per-call attention switches (split verification attention, CPU masked GQA)
- models: loading a model with its fingerprint
- prefill/: chunk blobs, the KV cache, stitching a prompt from blobs (rope, blob, cache, stitch…)
- decode/: producing tokens after a prefill (sampling math, fast steps, drafting, the loop)
- retrieval/: chunking, embeddings, cosine search (for RAPID's own retrieval and the CLI)
- store/: where blobs live (memory, disk, accelerator tiers behind one contract)
- engine, request, run, registry: TurboRAGEngine, a request and its one prefill, and the
  lifecycle of one streamed generation
- rapid/: RAPID — speculation rounds, and the facade over two engines

docs/concepts.md#architecture draws it.
"""

