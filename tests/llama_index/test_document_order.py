"""DocumentOrderPostprocessor in a stock query engine: retrieved nodes come back in their
document's order, and a document's consecutive chunks in that order, encoded after their
document's text before them, stitch to the full prefill of the same prompt — where the
retriever's score order does not."""

from __future__ import annotations

import pytest
import torch
from llama_index.core import PromptTemplate, StorageContext, VectorStoreIndex
from llama_index.core.schema import NodeRelationship, NodeWithScore, RelatedNodeInfo, TextNode

from tests.conftest import tiny_model
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.llama_index import (DocumentOrderPostprocessor, KVCachingVectorStore,
                                               TurboRAGLLM)

LIGHTHOUSE = [
    "The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora.",
    "It was first lit in 1871, and its lamp burned whale oil until 1923.",
    "The keeper's cottage below the tower became a museum of shipwrecks in 1962.",
    "Visitors climb the 212 steps of the lighthouse between April and October.",
]
KILN = ["The Orbital Kiln Company fires ceramic tiles for satellites in a vacuum furnace."]
QUESTION = "How many steps do visitors climb in the lighthouse?"
CONTEXT_FIRST = PromptTemplate("{context_str}\n\nQuestion: {query_str}\nAnswer:")


def document_nodes(doc_id: str, texts: list[str]) -> list[TextNode]:
    """One node per paragraph, linked and placed as a node parser links and places them."""
    nodes, start = [], 0
    for j, text in enumerate(texts):
        node = TextNode(text=text, id_=f"{doc_id}-{j}", start_char_idx=start,
                        end_char_idx=start + len(text))
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=doc_id)
        if j:
            node.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(
                node_id=nodes[-1].node_id)
            nodes[-1].relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=node.node_id)
        nodes.append(node)
        start += len(text) + 2
    return nodes


def test_nodes_are_regrouped_by_document_in_position_order_scores_kept():
    nodes = [NodeWithScore(node=n, score=s) for n, s in zip(
        [*document_nodes("a", ["a0", "a1", "a2"]), *document_nodes("b", ["b0", "b1"])],
        [0.5, 0.9, 0.7, 0.2, 0.8])]
    ranked = [nodes[i] for i in (1, 4, 2, 0, 3)]  # by score
    out = DocumentOrderPostprocessor().postprocess_nodes(ranked)
    assert [n.node.node_id for n in out] == ["a-0", "a-1", "a-2", "b-0", "b-1"]
    assert [n.score for n in out] == [0.5, 0.9, 0.7, 0.2, 0.8]
    loose = NodeWithScore(node=TextNode(text="no document"), score=0.95)
    out = DocumentOrderPostprocessor().postprocess_nodes([loose, *ranked])
    assert out[0] is loose and len(out) == 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # separators prefilled with the question: then every stitched token's KV can be the causal one
    return TurboRAGEngine(tiny_model("llama"), store=tmp_path_factory.mktemp("kv"),
                          separators=False, progress=False)


@pytest.fixture(scope="module")
def index(engine, embed_model, tmp_path_factory):
    store = KVCachingVectorStore(engine, path=tmp_path_factory.mktemp("chroma"))
    return VectorStoreIndex(document_nodes("lighthouse", LIGHTHOUSE) + document_nodes("kiln", KILN),
                            storage_context=StorageContext.from_defaults(vector_store=store),
                            embed_model=embed_model)


def ask(index, engine, postprocessors):
    """(the prompt the LLM got, the retrieved nodes' texts, the stitched and the full prefill's
    next-token logits for that prompt)."""
    prompts = []

    def to_prompt(messages):
        prompts.append(engine.anchor_text + "\n".join(m.content for m in messages))
        return prompts[-1]

    llm = TurboRAGLLM(engine, max_new_tokens=2, messages_to_prompt=to_prompt)
    qe = index.as_query_engine(llm=llm, similarity_top_k=len(LIGHTHOUSE),
                               node_postprocessors=[*postprocessors, llm.postprocessor()],
                               text_qa_template=CONTEXT_FIRST)
    response = qe.query(QUESTION)
    texts = [n.node.get_content() for n in response.source_nodes]
    assert llm.last_stats["cache_hits"] == len(LIGHTHOUSE)
    logits = {}
    for mode in ("turbo", "naive"):
        pre = engine.prefill(engine.assembly.segments(prompts[-1], texts if mode == "turbo" else ())[0])
        logits[mode] = pre.logits.reshape(-1).clone()
        engine.cache_pool.release(pre.cache)
    return prompts[-1], texts, logits


def test_document_order_makes_the_stitched_prompt_the_full_prefill(index, engine):
    prompt, texts, logits = ask(index, engine, [DocumentOrderPostprocessor()])
    assert texts == LIGHTHOUSE
    assert prompt.startswith(engine.anchor_text + "\n\n".join(LIGHTHOUSE) + "\n\n")
    torch.testing.assert_close(logits["turbo"], logits["naive"], atol=1e-4, rtol=0)


def test_score_order_is_not_the_document_order_and_stitches_inexactly(index, engine):
    prompt, texts, logits = ask(index, engine, [])
    assert sorted(texts) == sorted(LIGHTHOUSE) and texts != LIGHTHOUSE
    assert (logits["turbo"] - logits["naive"]).abs().max() > 1e-3
