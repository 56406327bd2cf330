"""RapidLLM on a tiny model: same tokens as the target's own greedy answer, streaming, stats."""

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.rapid import RapidEngine, split_question, target_greedy
from tests.conftest import tiny_model
from tests.llama_index.conftest import DOCS


def test_rapid_llm_complete_and_stream(tmp_path):
    from llama_index.core.schema import NodeWithScore, TextNode

    from turborag_integrations.llama_index import RapidLLM

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False)
    rapid = RapidEngine(engine, gamma=4)
    context = "\n\n".join(DOCS.values())
    prompt = context + "\n\nWhen does the ferry stop?"

    class Retriever:  # the retriever interface RapidLLM uses
        def retrieve(self, query):
            return [NodeWithScore(node=TextNode(text=DOCS["ferry"]), score=1.0)]

    llm = RapidLLM(rapid, retriever=Retriever(), max_new_tokens=20)
    response = llm.complete(prompt)
    stats = response.additional_kwargs["rapid"]
    assert stats["drafter_chunks"] == 1 and stats["drafter_reused_tokens"] > 0
    ctx, question = split_question(prompt)
    prefix, suffix = rapid.render(engine, ctx, question)
    assert llm.last_result.token_ids == target_greedy(engine, prefix, suffix, 20)
    streamed = list(llm.stream_complete(prompt))
    assert "".join(r.delta for r in streamed) == response.text
    assert streamed[-1].additional_kwargs["rapid"]["target_prefix_hit"]
