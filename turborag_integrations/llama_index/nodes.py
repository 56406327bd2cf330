"""How a node's chunk text is defined: the exact text the LLM will see in the prompt.

Ingestion (the vector store), retrieval (the postprocessor) and generation (the LLM) must agree
on this text to the byte, or a blob is never found. LlamaIndex puts
`node.get_content(metadata_mode=MetadataMode.LLM)` into its prompts; the compact synthesizer and
the chat engines strip it first, so the stripped text is used everywhere (it is also a substring
of the unstripped text, so it is found verbatim whichever form a prompt holds).
"""

from __future__ import annotations

from llama_index.core.schema import BaseNode, MetadataMode

KV_KEY_METADATA = "turborag_kv_key"


def llm_text(node: BaseNode) -> str:
    """The chunk text of `node` as the LLM sees it, stripped ('' when there is none)."""
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


def hide_kv_key(node: BaseNode) -> None:
    """Keep the blob-key metadata out of prompts and embeddings.

    New lists (not appends): nodes split from one document share its lists, and the document
    itself should not change.
    """
    for attr in ("excluded_llm_metadata_keys", "excluded_embed_metadata_keys"):
        keys = list(getattr(node, attr) or [])
        if KV_KEY_METADATA not in keys:
            keys.append(KV_KEY_METADATA)
        setattr(node, attr, keys)
