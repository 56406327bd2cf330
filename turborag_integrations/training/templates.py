"""The prompts stitched-chunk training should see: exactly what real pipelines send the model.

Training learns the prompt layout it is trained on. Trained on the evaluation prompt alone, a
chunk encoder can still falter on the prompt a stock LlamaIndex query engine or a LangChain RAG
chain sends through the TurboRAG adapters: another system prompt, another separator between
chunks, the question before or after the context. Each template here renders one (question,
chunks, answer) triple into the text the model receives in one such pipeline.

The texts are not copies. The LlamaIndex and LangChain templates are built with the installed
framework's own stock prompt objects and turned into prompt text by the adapters' own code
(`TurboRAGLLM.chat_prompt`, `TurboRAGChatModel.render`, over a tokenizer-only engine), so they
follow upgrades of either side. Chunks are joined the way each framework joins retrieved texts,
and `chunk_texts` gives each one as it occurs verbatim in the prompt: the spans a deployment
finds and stitches from cached KV.

    rendered = TEMPLATES["llama_index_text_qa"].render(tokenizer, question, chunks, answer)
    rendered.prompt       # the text up to where generation starts
    rendered.chunk_texts  # each chunk as it occurs in `prompt`
    rendered.completion   # what a correct reply adds after `prompt`, end of turn included

Templates:
    eval                 the evaluation prompt (evaluation/prompt.py::build_prompt)
    llama_index_text_qa  a stock query engine, compact mode: the chat text-QA prompt
    llama_index_refine   the chat refine prompt (refine mode, or compact mode overflowing the
                         window): new context plus the answer so far, here REFUSAL
    langchain_rag        the widely used LangChain RAG prompt, as one human message
    langchain_system     context in a system message, the question as the human message
    plain_chat           a short system prompt, then "Context information: ... Query: ..."
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence
from ..core.prompt_template import render_chat

# The answer so far in refine prompts, and the reply to a question the context cannot answer
# (training/mix.py). A model trained on this mix replies REFUSAL to chunks without the fact, so
# in a refine chain the earlier calls' answer is REFUSAL until the fact turns up.
REFUSAL = "The context does not say."

LLAMA_INDEX_SEPARATOR = "\n\n"  # PromptHelper.repack joins the stripped node texts with it
LANGCHAIN_SEPARATOR = "\n\n"  # the usual format_docs: "\n\n".join(d.page_content for d in docs)
LANGCHAIN_RAG_HUMAN = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\n"
    "Question: {question} \nContext: {context} \nAnswer:")
LANGCHAIN_SYSTEM = "Answer the question based only on the following context:\n\n{context}"
PLAIN_SYSTEM = "You are a helpful assistant. Answer the query using the context information."
PLAIN_SEPARATOR = "\n---\n"


@dataclass(frozen=True)
class RenderedPrompt:
    prompt: str  # the full text fed to the model, up to where generation starts
    chunk_texts: list[str]  # each chunk exactly as it occurs in `prompt`
    completion: str  # the text after `prompt` that a correct reply is, end of turn included


Render = Callable[[Any, str, Sequence[str], Optional[str]], RenderedPrompt]


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    render: Render  # (tokenizer, question, chunks, answer | None) -> RenderedPrompt
    description: str = ""


# ---- rendering through the adapters' own code -------------------------------------------------
class _ChatRecorder:
    """A tokenizer that remembers the last chat it rendered: the conversation behind a prompt
    that code such as `build_prompt` returns only as text, so the reply can be appended to it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.messages: list[dict] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def apply_chat_template(self, conversation, *args: Any, **kwargs: Any):
        self.messages = [dict(m) for m in conversation]
        return self.tokenizer.apply_chat_template(conversation, *args, **kwargs)


@functools.cache
def _chat_only_engine_class() -> type:
    from ..core.engine import TurboRAGEngine

    class ChatOnlyEngine(TurboRAGEngine):
        """A TurboRAGEngine with a tokenizer and no model: all the adapters need to turn
        messages into prompt text (`render_chat`), and nothing else works."""

        def __init__(self, tokenizer: Any):  # no super().__init__(): nothing is loaded
            self.tokenizer = tokenizer
            self.loaded = SimpleNamespace(name=str(getattr(tokenizer, "name_or_path", "")),
                                          context_window=32768)

    return ChatOnlyEngine


def chat_only_engine(tokenizer: Any):
    """An engine the adapters can be built on to render prompts, without loading a model."""
    return _chat_only_engine_class()(tokenizer)


def completion_after(recorder: _ChatRecorder, prompt: str, answer: Optional[str]) -> str:
    """The chat template's rendering of the reply `answer` after `prompt` (end of turn
    included); `answer` + EOS when there is no template or the prompt is not its prefix."""
    if answer is None:
        return ""
    if recorder.messages is not None:
        full = recorder.tokenizer.apply_chat_template(
            recorder.messages + [{"role": "assistant", "content": answer}], tokenize=False,
            add_generation_prompt=False)
        if full.startswith(prompt):
            return full[len(prompt):]
    return answer + (getattr(recorder.tokenizer, "eos_token", None) or "")


def _rendered(recorder: _ChatRecorder, prompt: str, chunk_texts: Sequence[str],
              answer: Optional[str]) -> RenderedPrompt:
    missing = [c for c in chunk_texts if c not in prompt]
    if missing:
        raise ValueError(f"{len(missing)} chunk text(s) not found verbatim in the prompt")
    return RenderedPrompt(prompt, list(chunk_texts), completion_after(recorder, prompt, answer))


def _stripped(chunks: Sequence[str]) -> list[str]:
    return [c.strip() for c in chunks if c.strip()]


# ---- the templates ----------------------------------------------------------------------------
def render_eval(tokenizer: Any, question: str, chunks: Sequence[str],
                answer: Optional[str]) -> RenderedPrompt:
    from ..evaluation.prompt import build_prompt

    recorder = _ChatRecorder(tokenizer)
    prompt, texts = build_prompt(recorder, question, chunks)
    return _rendered(recorder, prompt, texts, answer)


def _llama_index_prompt(recorder: _ChatRecorder, template: Any, **prompt_args: str) -> str:
    """The prompt TurboRAGLLM renders when a synthesizer calls `llm.predict(template, ...)`."""
    from ..core.registry import ChunkRegistry
    from ..llama_index.llm import TurboRAGLLM

    llm = TurboRAGLLM(engine=chat_only_engine(recorder), registry=ChunkRegistry(),
                      stock_head=False)  # it only renders: no blobs to encode
    # LLM.predict on a chat model: template.format_messages(llm=...) (the selector picks the
    # chat prompt for is_chat_model), plus any system prompt; then chat(messages).
    messages = llm._get_messages(template, **prompt_args)
    return llm.chat_prompt(messages)


def render_llama_index_text_qa(tokenizer: Any, question: str, chunks: Sequence[str],
                               answer: Optional[str]) -> RenderedPrompt:
    from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL

    texts = _stripped(chunks)
    recorder = _ChatRecorder(tokenizer)
    template = DEFAULT_TEXT_QA_PROMPT_SEL.partial_format(query_str=question)
    prompt = _llama_index_prompt(recorder, template,
                                 context_str=LLAMA_INDEX_SEPARATOR.join(texts))
    return _rendered(recorder, prompt, texts, answer)


def render_llama_index_refine(tokenizer: Any, question: str, chunks: Sequence[str],
                              answer: Optional[str]) -> RenderedPrompt:
    from llama_index.core.prompts.default_prompt_selectors import DEFAULT_REFINE_PROMPT_SEL

    texts = _stripped(chunks)
    recorder = _ChatRecorder(tokenizer)
    template = DEFAULT_REFINE_PROMPT_SEL.partial_format(query_str=question,
                                                        existing_answer=REFUSAL)
    prompt = _llama_index_prompt(recorder, template,
                                 context_msg=LLAMA_INDEX_SEPARATOR.join(texts))
    return _rendered(recorder, prompt, texts, answer)


def _langchain_prompt(recorder: _ChatRecorder, messages: list) -> str:
    """The prompt TurboRAGChatModel renders for LangChain `messages`."""
    from ..langchain.chat_model import TurboRAGChatModel

    return TurboRAGChatModel(engine=chat_only_engine(recorder)).render(messages)


def _render_langchain(tokenizer: Any, question: str, chunks: Sequence[str],
                      answer: Optional[str], message_templates: list) -> RenderedPrompt:
    from langchain_core.prompts import ChatPromptTemplate

    texts = list(chunks)
    value = ChatPromptTemplate.from_messages(message_templates).invoke(
        {"question": question, "context": LANGCHAIN_SEPARATOR.join(texts)})
    recorder = _ChatRecorder(tokenizer)
    prompt = _langchain_prompt(recorder, value.to_messages())
    return _rendered(recorder, prompt, texts, answer)


def render_langchain_rag(tokenizer: Any, question: str, chunks: Sequence[str],
                         answer: Optional[str]) -> RenderedPrompt:
    return _render_langchain(tokenizer, question, chunks, answer,
                             [("human", LANGCHAIN_RAG_HUMAN)])


def render_langchain_system(tokenizer: Any, question: str, chunks: Sequence[str],
                            answer: Optional[str]) -> RenderedPrompt:
    return _render_langchain(tokenizer, question, chunks, answer,
                             [("system", LANGCHAIN_SYSTEM), ("human", "{question}")])


def render_plain_chat(tokenizer: Any, question: str, chunks: Sequence[str],
                      answer: Optional[str]) -> RenderedPrompt:
    texts = list(chunks)
    user = "Context information:\n" + PLAIN_SEPARATOR.join(texts) + f"\nQuery: {question}"
    recorder = _ChatRecorder(tokenizer)
    prompt = render_chat(chat_only_engine(recorder).tokenizer,
        [{"role": "system", "content": PLAIN_SYSTEM}, {"role": "user", "content": user}])
    return _rendered(recorder, prompt, texts, answer)


TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate("eval", render_eval, "the evaluation prompt (build_prompt)"),
        PromptTemplate("llama_index_text_qa", render_llama_index_text_qa,
                       "stock LlamaIndex query engine, compact mode, through TurboRAGLLM"),
        PromptTemplate("llama_index_refine", render_llama_index_refine,
                       "stock LlamaIndex refine step (answer so far: REFUSAL), through "
                       "TurboRAGLLM"),
        PromptTemplate("langchain_rag", render_langchain_rag,
                       "the common LangChain RAG prompt (one human message), through "
                       "TurboRAGChatModel"),
        PromptTemplate("langchain_system", render_langchain_system,
                       "LangChain: context in the system message, question as the human "
                       "message, through TurboRAGChatModel"),
        PromptTemplate("plain_chat", render_plain_chat,
                       "short system prompt; 'Context information: ... Query: ...'"),
    )
}


def render(name: str, tokenizer: Any, question: str, chunks: Sequence[str],
           answer: Optional[str] = None) -> RenderedPrompt:
    """Render template `name` (a key of TEMPLATES)."""
    try:
        template = TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown template {name!r}; one of {sorted(TEMPLATES)}") from None
    return template.render(tokenizer, question, chunks, answer)
