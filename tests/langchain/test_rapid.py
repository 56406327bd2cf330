"""RapidChatModel on a tiny model: same tokens as the target's own greedy answer, streaming."""

from langchain_core.messages import HumanMessage

from turborag_integrations.core.rapid import RapidEngine, split_question, target_greedy


def test_rapid_chat_model_invoke_and_stream(engine):
    from turborag_integrations.langchain import RapidChatModel

    rapid = RapidEngine(engine, gamma=4)
    context = ("The ferry stops every January.\n\nThe kiln fires tiles at 1600 degrees.\n\n"
               "The lighthouse is 41 metres high.")
    prompt = context + "\n\nHow hot is the kiln?"
    llm = RapidChatModel(rapid=rapid, max_tokens=16)
    msg = llm.invoke([HumanMessage(prompt)], chunks=["The kiln fires tiles at 1600 degrees."])
    stats = msg.response_metadata["rapid"]
    assert stats["drafter_chunks"] == 1
    ctx, question = split_question(prompt)
    prefix, suffix = rapid.render(engine, ctx, question)
    expected = engine.tokenizer.decode(target_greedy(engine, prefix, suffix, 16),
                                       skip_special_tokens=True)
    assert msg.content == expected
    chunks = list(llm.stream([HumanMessage(prompt)], chunks=[]))
    assert "".join(c.content for c in chunks) == msg.content
    assert chunks[-1].response_metadata["rapid"]["target_prefix_hit"]
