"""question_last: question-first prompts turned so that stitched chunks come before the question."""

import pytest

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.reorder import question_last, turn_end, user_turn_opener
from turborag_integrations.core.settings import GenerationConfig

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles."]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OPENER = "<|im_end|>\n<|im_start|>user\n"
HEAD = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
TAIL = "<|im_end|>\n<|im_start|>assistant\n"
# LangChain's common RAG prompt puts the question first, LlamaIndex's default the context first
QUESTION_FIRST = ("Use the context to answer.\nQuestion: Where was Alice born? \nContext: "
                  + "\n\n".join(CHUNKS) + " \nAnswer:")
CONTEXT_FIRST = ("Context information is below.\n-----\n" + "\n\n".join(CHUNKS)
                 + "\n-----\nGiven the context information and not prior knowledge, answer the "
                   "query.\nQuery: Where was Alice born?\nAnswer: ")


def test_a_question_first_turn_gets_its_chunks_first():
    prompt = HEAD + QUESTION_FIRST + TAIL
    assert question_last(prompt, CHUNKS, OPENER) == (
        HEAD + "\n\n".join(CHUNKS) + "\n\n"
        + "Use the context to answer.\nQuestion: Where was Alice born? \nContext:"
        + " \nAnswer:" + TAIL)


def test_a_context_first_turn_and_a_prompt_without_chunks_stay_as_they_are():
    prompt = HEAD + CONTEXT_FIRST + TAIL
    assert question_last(prompt, CHUNKS, OPENER) == prompt
    assert question_last(HEAD + "Where was Alice born?" + TAIL, CHUNKS, OPENER) == \
        HEAD + "Where was Alice born?" + TAIL
    # chunks right at the start of the turn: no user text before them to move
    at_start = HEAD + "\n\n".join(CHUNKS) + "\nWhere was Alice born?" + TAIL
    assert question_last(at_start, CHUNKS, OPENER) == at_start


def test_only_the_last_user_turn_before_the_chunks_moves():
    """Earlier turns of a chat stay where they are; only the text of the turn holding the
    chunks, before them, follows them."""
    earlier = "Hi.<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n"
    prompt = HEAD + earlier + QUESTION_FIRST + TAIL
    turned = question_last(prompt, CHUNKS, OPENER)
    assert turned.startswith(HEAD + earlier + CHUNKS[0])
    assert turned.endswith("Question: Where was Alice born? \nContext: \nAnswer:" + TAIL)


def test_a_plain_prompt_treats_all_text_before_the_chunks_as_the_users():
    prompt = "Answer in one word. Where was Alice born?\n" + CHUNKS[0] + "\nA:"
    assert question_last(prompt, CHUNKS, None) == \
        CHUNKS[0] + "\n\nAnswer in one word. Where was Alice born?\nA:"


def test_the_opener_comes_from_the_chat_template(tiny):
    tokenizer = tiny.tokenizer
    tokenizer.chat_template = CHATML
    assert user_turn_opener(tokenizer) == OPENER
    assert turn_end(OPENER) == "<|im_end|>\n<|im_start|>"
    tokenizer.chat_template = None
    assert user_turn_opener(tokenizer) is None  # no template: plain prompts


@pytest.mark.parametrize("template", [QUESTION_FIRST, CONTEXT_FIRST])
def test_the_engine_option_equals_stitching_the_turned_prompt(tiny, tmp_path, template):
    """question_last=True generates exactly what stitching the turned prompt gives, and a full
    prefill keeps the prompt as written."""
    plain = TurboRAGEngine(tiny, store=tmp_path / "kv")
    turning = TurboRAGEngine(tiny, store=plain.store, question_last=True)
    plain.encode_chunks(CHUNKS)
    config = GenerationConfig(max_new_tokens=12)
    turned = question_last(template, CHUNKS, turning.assembly.user_opener)
    assert (turned != template) == (template is QUESTION_FIRST)

    got = turning.generate(template, chunks=CHUNKS, config=config)
    want = plain.generate(turned, chunks=CHUNKS, config=config)
    assert got.token_ids == want.token_ids
    assert got.stats.prompt_tokens == want.stats.prompt_tokens
    assert got.stats.reused_tokens == want.stats.reused_tokens > 0
    assert got.stats.extra.get("question_last", False) == (template is QUESTION_FIRST)
    assert "question_last" not in want.stats.extra

    naive = turning.generate(template, chunks=CHUNKS, config=config, mode="naive")
    assert naive.token_ids == plain.generate(template, config=config, mode="naive").token_ids
