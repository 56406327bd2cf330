"""LangChain's token counting uses the model's own tokenizer: offline, without loading weights."""

from langchain_core.messages import HumanMessage

from turborag_integrations.langchain import TurboRAGChatModel, TurboRAGLLM
from turborag_integrations.langchain import generation

TEXT = "How high is the Tall Widow lighthouse on the cliffs of Velmora?"


def test_get_num_tokens_counts_with_the_models_tokenizer_offline(model_dir, monkeypatch):
    from transformers import AutoTokenizer

    expected = len(AutoTokenizer.from_pretrained(model_dir)(TEXT, add_special_tokens=False)
                   ["input_ids"])
    loads = []
    monkeypatch.setattr(generation, "shared_engine", lambda *a: loads.append(a))
    generation.shared_tokenizer.cache_clear()
    for cls in (TurboRAGChatModel, TurboRAGLLM):
        assert cls(model=model_dir).get_num_tokens(TEXT) == expected
    assert loads == []  # counting never loaded the weights
    chat = TurboRAGChatModel(model=model_dir)
    assert chat.get_num_tokens_from_messages([HumanMessage(TEXT)]) > expected  # + the role


def test_get_num_tokens_uses_a_given_engines_tokenizer(engine):
    chat = TurboRAGChatModel(engine=engine)
    assert chat.get_token_ids(TEXT) == engine.tokenizer(TEXT, add_special_tokens=False)[
        "input_ids"]
    assert TurboRAGChatModel(engine=engine, custom_get_token_ids=lambda t: [1, 2]) \
        .get_num_tokens(TEXT) == 2
