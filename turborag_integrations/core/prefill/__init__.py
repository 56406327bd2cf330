"""Prefill: chunk blobs encoded once (blob, anchor, rope), the preallocated KV cache, and a
prompt's prefill stitched from blobs plus the text around them (segment, stitch, recovery)."""
