"""The framework-free engine: models, KV blobs, the store, stitching and generation."""
