"""core/retrieval/order.py: retrieved chunks regrouped by document, in document order."""

from turborag_integrations.core.retrieval.order import document_order


def test_each_documents_chunks_come_together_where_its_best_chunk_was_in_position_order():
    keys = [("a", 300), ("b", 50), ("a", 100), ("b", 0), ("a", 200)]
    assert document_order(keys) == [2, 4, 0, 3, 1]


def test_chunks_without_a_document_keep_their_place_among_the_groups():
    keys = [(None, None), ("a", 9), (None, 0), ("a", 1)]
    assert document_order(keys) == [0, 3, 1, 2]


def test_a_document_with_an_unknown_position_keeps_retrieval_order():
    keys = [("a", 30), ("a", None), ("a", 10), ("b", 5), ("b", 1)]
    assert document_order(keys) == [0, 1, 2, 4, 3]
    # a flag is not a position
    assert document_order([("a", True), ("a", 0)]) == [0, 1]


def test_equal_positions_keep_their_rank_and_nothing_is_lost():
    keys = [("a", 5), ("a", 5), ("a", 1)]
    assert document_order(keys) == [2, 0, 1]
    assert document_order([]) == []
