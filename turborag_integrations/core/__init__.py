"""The framework-free engine. Layers, each importing only those above it in this list
(tests/test_architecture.py checks it):

- settings, errors, environment, tensorfile, transformers_api: what a caller can choose, what
  can go wrong, the one place the environment is read, blob files, the transformers calls
- attention: per-call attention switches (split verification attention, CPU masked GQA)
- kv/: a chunk's blob and its fingerprint, the KV cache, its pool and the decode arena
- prefill/: from blobs to one cache: encoding chunks (anchor, context, learned encoding),
  re-rotating keys, stitching a prompt, recovering tokens at query time (recovery, relevance)
- decode/: producing tokens after a prefill (sampling math, fast steps, drafting, the loop)
- retrieval/: chunking, embeddings, cosine search, document order (RAPID's own retrieval, the CLI)
- models, checkpoint: loading a model (device, dtype) with its fingerprint
- store/: where blobs live (memory, disk, Redis tiers behind one contract; budget, eviction)
- engine, library, assembly, request, run, registry, batching, batch_worker, scheduled,
  async_iter, prompt_template: TurboRAGEngine, the chunk library and prompt assembly it has, a
  request and its one prefill, a streamed generation, and the batch scheduler that serves many
- rapid/: RAPID — speculation rounds, and the facade over two engines

docs/concepts.md#architecture draws it.
"""

