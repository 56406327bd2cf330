"""Separators between chunks: their in-context token ids, and stored when chunks are encoded."""

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.kv.blob import chunk_key
from turborag_integrations.core.prefill.separators import separator_ids

from tests.conftest import byte_tokenizer, tiny_model


def test_separator_ids_are_those_of_a_whole_prompt_not_of_the_text_alone():
    tok = byte_tokenizer(merges=(("Ċ", "Ċ"),))
    nl = tok.convert_tokens_to_ids("Ċ")
    # alone, "\n\n" is the merged token; between two words the pre-tokenizer splits it in two
    assert tok("\n\n", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("ĊĊ")]
    runs = separator_ids(tok, ["\n\n"])
    assert [nl, nl] in runs and [tok.convert_tokens_to_ids("ĊĊ")] not in runs
    whole = tok("end.\n\nNext", add_special_tokens=False)["input_ids"]
    assert [nl, nl] == whole[4:6]


def test_separators_longer_than_the_limit_are_left_out():
    tok = byte_tokenizer()
    assert separator_ids(tok, ["\n---------\n"]) == []  # 11 byte tokens


def test_encode_separators_stores_the_stock_separators_like_chunks_once(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=str(tmp_path / "kv"), progress=False)
    engine.encode_chunks(["A first chunk of text.", "A second chunk of text."])
    assert len(engine.store.keys()) == 2  # chunks alone: separators only when asked for
    keys = engine.library.encode_separators()
    runs = separator_ids(engine.tokenizer)
    assert runs and keys == [chunk_key(engine.fingerprint, r) for r in runs]
    assert all(engine.store.contains(k) for k in keys)
    blob = engine.store.get(keys[0], engine.fingerprint)
    assert blob.token_ids.tolist() == runs[0]
    assert blob.base_position == engine.library.encoder.base_position  # encoded like a chunk
    before = set(engine.store.keys())
    again = TurboRAGEngine(engine.loaded, store=engine.store, progress=False)
    assert again.library.encode_separators() == keys and set(engine.store.keys()) == before
