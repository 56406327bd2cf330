"""Device and dtype on every surface that loads a model: checked before anything loads, and
a bf16 model (weights and blobs) answering in the stock LlamaIndex and LangChain pipelines."""

import pytest
import torch

from turborag_integrations.core.errors import ModelError
from turborag_integrations.core.models import available_devices, load_model, parse_device, \
    parse_dtype

NO_CUDA = not torch.cuda.is_available()
TEXTS = ["The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora.",
         "The Velmora ferry stops running every January, when the harbour freezes over.",
         "The Orbital Kiln Company fires ceramic tiles for satellites in a vacuum furnace."]


def test_auto_picks_a_device_that_is_here_and_cpu_always_is():
    assert str(parse_device("auto")) in available_devices()
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_dtype("auto") == "auto" and parse_dtype("bf16") is torch.bfloat16


@pytest.mark.parametrize("device, says", [
    ("gpu", "unknown device 'gpu'; use cpu, cuda, cuda:N, mps or auto"),
    ("no-such-device", "unknown device 'no-such-device'"),
])
def test_an_unknown_device_is_refused_naming_the_forms(device, says):
    with pytest.raises(ModelError, match=says):
        parse_device(device)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_naming_what_is_available():
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ModelError, match=r"is not available .*available here: cpu"):
            parse_device(device)


def test_a_bad_device_fails_before_the_model_loads(monkeypatch):
    from turborag_integrations.core import models

    monkeypatch.setattr(models, "model_source", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ModelError, match="unknown device"):
        load_model("anything", device="gpu")
    with pytest.raises(ModelError, match="unknown dtype 'half'"):
        load_model("anything", dtype="half")


def test_auto_dtype_keeps_the_checkpoints(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    assert load_model(str(folder), dtype="auto", progress=False).dtype is torch.bfloat16
    assert load_model(str(folder), progress=False).dtype is torch.float32  # the default


def test_llama_index_llm_in_bf16_answers_in_a_stock_query_engine(model_dir, tmp_path):
    from llama_index.core import Document, StorageContext, VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from turborag_integrations.core.retrieval.embedding import default_embedding_path
    from turborag_integrations.llama_index import KVCachingVectorStore, TurboRAGLLM

    with pytest.raises(ModelError, match="unknown device 'no-such-device'"):
        TurboRAGLLM(model_name=model_dir, device="no-such-device")
    llm = TurboRAGLLM(model_name=model_dir, store_path=str(tmp_path / "kv"), device="cpu",
                      dtype="bfloat16", max_new_tokens=4)
    engine = llm.engine
    assert engine.loaded.dtype is torch.bfloat16 and engine.fingerprint.dtype == "bfloat16"
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in TEXTS],
        embed_model=HuggingFaceEmbedding(model_name=default_embedding_path()),
        storage_context=StorageContext.from_defaults(vector_store=store))
    qe = index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()],
                               similarity_top_k=2)
    qe.query("How high is the lighthouse?")
    assert llm.last_stats["cache_hits"] == 2 and llm.last_stats["cache_misses"] == 0
    assert engine.library.blob_for(TEXTS[0]).keys.dtype is torch.bfloat16


def test_langchain_chat_model_in_bf16_answers_in_an_lcel_chain(model_dir, tmp_path):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    from turborag_integrations.langchain import (KVCachingVectorStore,
                                                 SentenceTransformerEmbeddings,
                                                 TurboRAGChatModel)

    with pytest.raises(ModelError, match="unknown device 'gpu'"):
        TurboRAGChatModel(model=model_dir, device="gpu")
    with pytest.raises(ModelError, match="unknown dtype"):
        KVCachingVectorStore(model=model_dir, dtype="half")
    store = KVCachingVectorStore.from_texts(
        TEXTS, SentenceTransformerEmbeddings(), model=model_dir, dtype="bfloat16",
        persist_directory=str(tmp_path / "chroma"))
    llm = TurboRAGChatModel(model=model_dir, dtype="bfloat16", max_tokens=4)
    assert llm.get_engine() is store.engine  # one engine per model, device and dtype
    assert store.engine.fingerprint.dtype == "bfloat16"
    prompt = ChatPromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}")
    chain = ({"context": store.as_retriever(search_kwargs={"k": 2})
              | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | prompt | llm)
    msg = chain.invoke("How high is the lighthouse?")
    assert msg.response_metadata["turborag"]["cache_hits"] == 2
